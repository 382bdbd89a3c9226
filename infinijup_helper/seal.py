"""Sealing images at dump and checking the seal at restore.

Why: images live in the caller's work dir, owned by the caller, and CRIU restores them as root.
Image *metadata* (files.img naming paths to open, mm, pstree, creds, ...) tells a root process
what to do, so an edited image would let any local user have root open /etc/shadow for them.
The helper therefore records, at dump, the uid the images belong to, the size and SHA-256 of
every file and an HMAC over all of it under a key only root can read, and a non-root restore
uses only images sealed for that caller, and only files whose bytes match. The private memory of
the tasks below the tree root (most of the bytes) is sealed by size only: hashing gigabytes would
double the cost of a dump, and those bytes only become memory of processes that run with the
caller's own credentials, which the caller could write anyway. The root-owned init's memory is
hashed like the rest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from .protocol import RequestError

SEAL_NAME = "infinijup-seal.json"
KEY_BYTES = 32
CHUNK = 1 << 20
UNSEALED_NAMES = frozenset({SEAL_NAME, "stats-dump", "stats-restore"})


def is_sealed_name(name: str) -> bool:
    """Logs and CRIU's statistics are not part of an image; everything else is."""
    return name not in UNSEALED_NAMES and not name.endswith(".log")


@dataclass(frozen=True)
class FileSeal:
    size: int
    sha256: str | None  # None: sealed by size only


@dataclass(frozen=True)
class Seal:
    owner: int
    files: Mapping[str, FileSeal]


def untrusted(message: str) -> RequestError:
    return RequestError("permission_denied", f"images are not trusted: {message}")


class Sealer:
    def __init__(self, key_path: str) -> None:
        self._key = self._load_or_create_key(key_path)

    @staticmethod
    def _load_or_create_key(path: str) -> bytes:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            return Sealer._read_key(path)
        key = secrets.token_bytes(KEY_BYTES)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        return key

    @staticmethod
    def _read_key(path: str) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
                raise RuntimeError(f"{path} must be owned by root and mode 0600")
            key = f.read()
        if len(key) != KEY_BYTES:
            raise RuntimeError(f"{path} is not a seal key ({len(key)} bytes)")
        return key

    def _mac(self, owner: int, files: Mapping[str, FileSeal]) -> str:
        body = json.dumps(
            [owner, {name: [s.size, s.sha256] for name, s in sorted(files.items())}],
            separators=(",", ":"),
        ).encode()
        return hmac.new(self._key, body, hashlib.sha256).hexdigest()

    def seal(self, dir_fd: int, owner: int, size_only: set[str]) -> None:
        """Write the seal file into a (root-only) staging dir of freshly dumped images."""
        files: dict[str, FileSeal] = {}
        for entry in os.scandir(dir_fd):
            if not entry.is_file(follow_symlinks=False) or not is_sealed_name(entry.name):
                continue
            fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                size = os.fstat(fd).st_size
                digest = None if entry.name in size_only else hash_fd(fd)
            finally:
                os.close(fd)
            files[entry.name] = FileSeal(size, digest)
        doc = {
            "v": 1,
            "owner": owner,
            "files": {n: {"size": s.size, "sha256": s.sha256} for n, s in sorted(files.items())},
            "mac": self._mac(owner, files),
        }
        fd = os.open(
            SEAL_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd
        )
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)

    def read(self, dir_fd: int) -> Seal:
        """The seal of an images dir, if its HMAC is ours; else refuse."""
        try:
            fd = os.open(SEAL_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            raise untrusted(f"no {SEAL_NAME} (not dumped by this helper)") from None
        except OSError as exc:
            raise untrusted(f"{SEAL_NAME} cannot be opened: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            raw = f.read(16 * 1024 * 1024)
        try:
            doc = json.loads(raw)
            files = {
                str(name): FileSeal(
                    int(v["size"]), None if v["sha256"] is None else str(v["sha256"])
                )
                for name, v in doc["files"].items()
            }
            owner = int(doc["owner"])
            mac = str(doc["mac"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise untrusted(f"{SEAL_NAME} is malformed") from None
        if not hmac.compare_digest(mac, self._mac(owner, files)):
            raise untrusted("the seal does not match (modified, or dumped by another helper: "
                            "to restore another machine's snapshots, its helper and this one "
                            "must have the same seal key, the .seal-key of their work dirs)")
        for name in files:
            if "/" in name or name in (".", "..") or not is_sealed_name(name):
                raise untrusted(f"the seal names an invalid file {name!r}")
        return Seal(owner=owner, files=files)


def hash_fd(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, CHUNK):
        digest.update(chunk)
    return digest.hexdigest()
