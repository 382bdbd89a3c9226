"""Keys of an encrypted remote: a master key wrapped by key slots, as in restic.

On the remote (beside the data, remote_repo.py)::

    config          {"format": "infinijup-remote", "version": 1, "id": <32 hex>,
                     "encryption": "aes-256-gcm+blake3"}   (plain JSON: no secret in it)
    keys/<slot id>  one key slot (JSON): how to derive its key-encryption key, and the
                    master key and repository id sealed with it (AES-256-GCM)

A slot is opened by a *password* (Argon2id, memory-hard: 64 MiB, 3 passes, 4 lanes by
default; the parameters and salt are in the slot) or a *key file* (a random 32-byte secret,
``infinijup-key-file 1`` then 64 hex digits; its key is derived with BLAKE3 and a salt).
Every slot wraps the same master key, so adding, removing or changing one never re-encrypts
data. Lose every password and key file and the data cannot be read by anyone: there is no
recovery.

Non-interactive use (servers, scripts): ``$INFINIJUP_STORE_PASSWORD_FILE`` (a file holding
the password; one trailing newline is ignored) or ``$INFINIJUP_STORE_KEY_FILE`` (a key file).
``$INFINIJUP_REMOTE_UNENCRYPTED=1`` allows pushing to a remote without encryption.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import fsutil
from .crypto import KEY_BYTES, REPO_ID_BYTES, RepoKey, random_key
from .errors import RemoteCorrupt, RemoteError, RemoteKeyError, RemoteWrongKey
from .s3 import PreconditionFailed, S3Bucket

PASSWORD_FILE_ENV = "INFINIJUP_STORE_PASSWORD_FILE"
KEY_FILE_ENV = "INFINIJUP_STORE_KEY_FILE"
UNENCRYPTED_ENV = "INFINIJUP_REMOTE_UNENCRYPTED"
CONFIG = "config"
FORMAT = "infinijup-remote"
ENCRYPTION = "aes-256-gcm+blake3"
KEY_FILE_HEAD = "infinijup-key-file 1"
_SLOT_AD = b"infinijup key slot 1\0"
_KEYFILE_CONTEXT = "infinijup remote 2026-11 key file"


@dataclass(frozen=True)
class KdfParams:
    """Argon2id parameters of a password slot."""

    time_cost: int = 3
    memory_kib: int = 64 * 1024
    parallelism: int = 4


@dataclass(frozen=True)
class Credentials:
    """What the user holds to open a remote: a password and/or a key file; and whether a
    remote without encryption may be used for pushes (``unencrypted``)."""

    password: bytes | None = field(default=None, repr=False)
    key_file: Path | None = None
    unencrypted: bool = False

    @property
    def has_key(self) -> bool:
        return self.password is not None or self.key_file is not None

    @classmethod
    def from_env(cls) -> Credentials:
        """``$INFINIJUP_STORE_PASSWORD_FILE``, ``$INFINIJUP_STORE_KEY_FILE`` and
        ``$INFINIJUP_REMOTE_UNENCRYPTED``."""
        return cls.build(password_file=os.environ.get(PASSWORD_FILE_ENV) or None,
                         key_file=os.environ.get(KEY_FILE_ENV) or None,
                         unencrypted=os.environ.get(UNENCRYPTED_ENV, "") in ("1", "true",
                                                                              "yes"))

    @classmethod
    def resolve(cls, password_file: str = "", key_file: str = "", unencrypted: bool = False
                ) -> Credentials:
        """Settings (say, a server's config) where given, else the environment's."""
        if password_file or key_file:
            return cls.build(password_file=password_file or None, key_file=key_file or None,
                             unencrypted=unencrypted)
        env = cls.from_env()
        return cls(env.password, env.key_file, unencrypted or env.unencrypted)

    @classmethod
    def build(cls, *, password_file: str | os.PathLike[str] | None = None,
              key_file: str | os.PathLike[str] | None = None, unencrypted: bool = False
              ) -> Credentials:
        """Credentials from a password file and/or a key file path."""
        return cls(read_password_file(password_file) if password_file else None,
                   Path(key_file) if key_file else None, unencrypted)


def read_password_file(path: str | os.PathLike[str]) -> bytes:
    """The password in ``path`` (one trailing newline dropped)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RemoteKeyError(f"cannot read the password file {path}: {exc.strerror}") from None
    for end in (b"\r\n", b"\n"):
        if data.endswith(end):
            data = data[:-len(end)]
            break
    if not data:
        raise RemoteKeyError(f"the password file {path} is empty")
    return data


def create_key_file(path: str | os.PathLike[str]) -> bytes:
    """Write a new key file at ``path`` (refused if something is there); its secret."""
    secret = random_key()
    try:
        fd = fsutil.open_private(Path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        raise RemoteKeyError(f"{path} exists: a new key file is never written over "
                             "another file") from None
    try:
        os.write(fd, f"{KEY_FILE_HEAD}\n{secret.hex()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return secret


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The secret of the key file at ``path``."""
    try:
        lines = Path(path).read_text().split()
    except (OSError, UnicodeDecodeError) as exc:
        raise RemoteKeyError(f"cannot read the key file {path}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    if (len(lines) != 3 or " ".join(lines[:2]) != KEY_FILE_HEAD or len(lines[2]) != 64
            or any(c not in "0123456789abcdef" for c in lines[2])):
        raise RemoteKeyError(f"{path} is not an infinijup key file")
    return bytes.fromhex(lines[2])


@dataclass(frozen=True)
class Slot:
    """A key slot as listed (nothing secret)."""

    id: str
    type: str  # "password" or "key-file"
    created: float
    label: str


@dataclass(frozen=True)
class Unlocked:
    """An opened repository: its key, and the slot that opened it."""

    key: RepoKey = field(repr=False)
    master: bytes = field(repr=False)
    repo_id: str
    slot: str


# -- config ----------------------------------------------------------------------------------

def read_config(bucket: S3Bucket) -> dict | None:
    """The remote's config; None when it has none (empty, or an unencrypted store)."""
    got = bucket.get(CONFIG)
    if got is None:
        return None
    try:
        cfg = json.loads(got[0])
        ok = (cfg.get("format") == FORMAT and isinstance(cfg.get("id"), str)
              and len(cfg["id"]) == 2 * REPO_ID_BYTES)
        bytes.fromhex(cfg["id"])
    except (ValueError, AttributeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise RemoteCorrupt(f"the config of {bucket.url} is damaged or not an Infinijup "
                            "remote's")
    if cfg.get("version") != 1 or cfg.get("encryption") != ENCRYPTION:
        raise RemoteError(f"{bucket.url} uses remote format {cfg.get('version')} / "
                          f"{cfg.get('encryption')!r}, which this version cannot read")
    return cfg


def init_remote(bucket: S3Bucket, creds: Credentials, *, label: str = "",
                kdf: KdfParams | None = None) -> Unlocked:
    """Make an empty remote an encrypted one: a new master key, its first slot (from
    ``creds``: a password, or a key file created if absent), then the config."""
    if not creds.has_key:
        raise RemoteKeyError("a new encrypted remote needs a password or a key file")
    if read_config(bucket) is not None:
        raise RemoteKeyError(f"{bucket.url} is already encrypted (`key add` adds a key)")
    if bucket.list(""):
        raise RemoteKeyError(f"{bucket.url} is not empty (it holds an unencrypted store or "
                             "other files); encrypt into a new prefix and push there")
    master, repo_id = random_key(), secrets.token_bytes(REPO_ID_BYTES)
    slot = add_slot(bucket, master, repo_id, creds, label=label, kdf=kdf)
    cfg = {"format": FORMAT, "version": 1, "id": repo_id.hex(), "encryption": ENCRYPTION}
    try:
        bucket.put(CONFIG, json.dumps(cfg, sort_keys=True).encode(), if_absent=True)
    except PreconditionFailed:
        bucket.delete(f"keys/{slot}")
        raise RemoteKeyError(f"{bucket.url} was made an encrypted remote by someone else "
                             "meanwhile") from None
    return Unlocked(RepoKey(master, repo_id), master, repo_id.hex(), slot)


# -- slots -------------------------------------------------------------------------------------

def _kek(slot: dict, creds: Credentials) -> bytes | None:
    """The key-encryption key of ``slot`` from ``creds``; None if they cannot open it."""
    kdf = slot["kdf"]
    salt = bytes.fromhex(kdf["salt"])
    if slot["type"] == "password" and creds.password is not None:
        from argon2.low_level import Type, hash_secret_raw

        t, m, p = int(kdf["time_cost"]), int(kdf["memory_kib"]), int(kdf["parallelism"])
        if not (1 <= t <= 64 and 8 * p <= m <= 4 << 20 and 1 <= p <= 64):
            raise RemoteCorrupt(f"key slot {slot['id']} has unreasonable Argon2 parameters")
        return hash_secret_raw(creds.password, salt, t, m, p, KEY_BYTES, Type.ID)
    if slot["type"] == "key-file" and creds.key_file is not None:
        secret = read_key_file(creds.key_file)
        return blake3.blake3(salt + secret, derive_key_context=_KEYFILE_CONTEXT).digest()
    return None


def add_slot(bucket: S3Bucket, master: bytes, repo_id: bytes, creds: Credentials, *,
             label: str = "", kdf: KdfParams | None = None) -> str:
    """Wrap ``master`` in a new slot opened by ``creds`` (a password, else a key file, which
    is created when absent); returns the slot id."""
    slot_id = secrets.token_hex(8)
    salt = secrets.token_bytes(16)
    if creds.password is not None:
        k = kdf or KdfParams()
        slot = {"type": "password", "kdf": {"name": "argon2id", "time_cost": k.time_cost,
                                            "memory_kib": k.memory_kib,
                                            "parallelism": k.parallelism, "salt": salt.hex()}}
    elif creds.key_file is not None:
        if not creds.key_file.exists():
            create_key_file(creds.key_file)
        slot = {"type": "key-file", "kdf": {"name": "blake3", "salt": salt.hex()}}
        creds = Credentials(key_file=creds.key_file)
    else:
        raise RemoteKeyError("a key slot needs a password or a key file")
    slot.update({"version": 1, "id": slot_id, "created": time.time(), "label": label})
    kek = _kek(slot, creds)
    assert kek is not None
    nonce = secrets.token_bytes(12)
    sealed = AESGCM(kek).encrypt(nonce, master + repo_id, _SLOT_AD + slot_id.encode())
    slot["key"] = base64.b64encode(nonce + sealed).decode()
    bucket.put(f"keys/{slot_id}", json.dumps(slot, sort_keys=True).encode(), if_absent=True)
    return slot_id


def _slots(bucket: S3Bucket) -> list[dict]:
    out = []
    for name in sorted(bucket.list("keys/")):
        got = bucket.get(name)
        if got is None:  # removed meanwhile
            continue
        try:
            slot = json.loads(got[0])
            if (slot["id"] != name.rsplit("/", 1)[1] or slot["type"] not in
                    ("password", "key-file") or not isinstance(slot["kdf"]["salt"], str)):
                raise ValueError(name)
        except (ValueError, KeyError, TypeError):
            raise RemoteCorrupt(f"key slot {name} of {bucket.url} is damaged") from None
        out.append(slot)
    return out


def list_slots(bucket: S3Bucket) -> list[Slot]:
    """The remote's key slots, oldest first."""
    slots = [Slot(s["id"], s["type"], float(s.get("created", 0)), str(s.get("label", "")))
             for s in _slots(bucket)]
    return sorted(slots, key=lambda s: (s.created, s.id))


def unlock(bucket: S3Bucket, cfg: dict, creds: Credentials) -> Unlocked:
    """Open the master key with ``creds``: the first slot they open (RemoteWrongKey if
    none)."""
    slots = _slots(bucket)
    tried = 0
    for slot in slots:
        try:
            kek = _kek(slot, creds)
        except (KeyError, ValueError, TypeError):
            raise RemoteCorrupt(f"key slot {slot['id']} of {bucket.url} is damaged") from None
        if kek is None:
            continue
        tried += 1
        try:
            raw = base64.b64decode(slot["key"], validate=True)
            plain = AESGCM(kek).decrypt(raw[:12], raw[12:], _SLOT_AD + slot["id"].encode())
        except (InvalidTag, ValueError, KeyError, TypeError):
            continue
        master, repo_id = plain[:KEY_BYTES], plain[KEY_BYTES:]
        if repo_id.hex() != cfg["id"] or len(master) != KEY_BYTES:
            raise RemoteCorrupt(f"the config of {bucket.url} does not match its key slots "
                                "(replaced or from another repository)")
        return Unlocked(RepoKey(master, repo_id), master, cfg["id"], slot["id"])
    what = " and ".join(w for w, given in (("password", creds.password is not None),
                                          ("key file", creds.key_file is not None)) if given)
    raise RemoteWrongKey(
        f"no key slot of {bucket.url} opens with this {what} ({tried} of {len(slots)} "
        "slots tried): a wrong password, or its slot was removed. Without a key that opens "
        "it the data cannot be read by anyone; a lost key cannot be recovered")


def remove_slot(bucket: S3Bucket, slot_id: str, current: str) -> None:
    """Remove a slot: never the one in use (``current``), never the last one."""
    ids = {s.id for s in list_slots(bucket)}
    if slot_id not in ids:
        raise RemoteKeyError(f"no key slot {slot_id!r} on {bucket.url} (see `key list`)")
    if slot_id == current:
        raise RemoteKeyError(f"key slot {slot_id} is the one that opened {bucket.url}; open "
                             "it with another key to remove this one (or use `key passwd`)")
    if len(ids) == 1:
        raise RemoteKeyError("the last key slot cannot be removed: the data could never be "
                             "read again")
    bucket.delete(f"keys/{slot_id}")


def change_password(bucket: S3Bucket, opened: Unlocked, new: Credentials, *,
                    label: str = "", kdf: KdfParams | None = None) -> str:
    """Replace the slot that opened the remote by one for ``new``; the new slot's id."""
    slot = add_slot(bucket, opened.master, bytes.fromhex(opened.repo_id), new, label=label,
                    kdf=kdf)
    bucket.delete(f"keys/{opened.slot}")
    return slot


__all__ = ["CONFIG", "Credentials", "KEY_FILE_ENV", "KdfParams", "PASSWORD_FILE_ENV", "Slot",
           "UNENCRYPTED_ENV", "Unlocked", "add_slot", "change_password", "create_key_file",
           "init_remote", "list_slots", "read_config", "read_key_file", "read_password_file",
           "remove_slot", "unlock"]
