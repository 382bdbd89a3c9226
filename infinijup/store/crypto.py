"""Authenticated encryption of what leaves the machine: the objects of an encrypted remote.

A remote repository has one *master key* (32 random bytes, wrapped by key slots: keys.py).
Two keys are derived from it with BLAKE3's key derivation, so neither is ever used for the
other's job:

* the *name key*: an object's remote name is ``BLAKE3-keyed(name key, kind || 0 || id)`` of
  its plaintext id (a pack's, a commit's; a ref's thread name). Only a key holder can
  compute it: nobody can test the bucket for a known file's hash, and the user's own pushes
  still find what is already there (the same id gives the same name: dedup keeps working).
* the *data key*: every object is sealed with AES-256-GCM under a key of its own,
  ``BLAKE3-keyed(data key, magic || salt || kind || 0 || name || 0 || repository id)``
  with a fresh random 24-byte salt per object. An object copied under another name, of
  another kind or from another repository derives another key and does not open.

A sealed object (``MAGIC`` + salt + segments) is cut into segments of ``SEGMENT`` plaintext
bytes, each sealed with the nonce ``counter (11 bytes, big-endian) || last flag`` (the STREAM
construction, as in age): reordered, dropped or truncated segments do not open, and the last
segment is marked, so a truncated object is refused. Large objects (packs) are sealed and
opened as streams (``EncryptingReader``, ``DecryptingWriter``), never held in memory.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"IJE1"
SALT = 24
TAG = 16
SEGMENT = 1 << 20  # plaintext bytes per sealed segment
KEY_BYTES = 32
REPO_ID_BYTES = 16
_HEAD = len(MAGIC) + SALT
_CONTEXT = "infinijup remote 2026-11 {} key"


class NotAuthentic(Exception):
    """A sealed object does not open: damaged, truncated, renamed, or not this repository's
    (callers say which object, and refuse it)."""


def sealed_size(n: int) -> int:
    """The size of a sealed object of ``n`` plaintext bytes."""
    return _HEAD + n + TAG * max(1, -(-n // SEGMENT))


def _nonce(i: int, last: bool) -> bytes:
    return i.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


class RepoKey:
    """The master key of one repository, and what is derived from it."""

    def __init__(self, master: bytes, repo_id: bytes) -> None:
        if len(master) != KEY_BYTES or len(repo_id) != REPO_ID_BYTES:
            raise ValueError("a master key is 32 bytes and a repository id 16")
        self.repo_id = repo_id
        self._data = blake3.blake3(master, derive_key_context=_CONTEXT.format("data")).digest()
        self._names = blake3.blake3(master, derive_key_context=_CONTEXT.format("name")).digest()

    def name(self, kind: str, ident: bytes) -> str:
        """The remote name (64 hex digits) of the object of ``kind`` with plaintext id
        ``ident``."""
        return blake3.blake3(kind.encode() + b"\0" + ident, key=self._names).hexdigest()

    def _aead(self, kind: str, name: str, salt: bytes) -> AESGCM:
        info = MAGIC + salt + kind.encode() + b"\0" + name.encode() + b"\0" + self.repo_id
        return AESGCM(blake3.blake3(info, key=self._data).digest())

    # -- whole objects (commits, manifests, refs) ----------------------------------------
    def seal(self, kind: str, name: str, data: bytes) -> bytes:
        """``data`` sealed as the object ``name`` of ``kind``."""
        salt = os.urandom(SALT)
        aead = self._aead(kind, name, salt)
        view = memoryview(data)
        count = max(1, -(-len(data) // SEGMENT))
        parts = [MAGIC, salt]
        for i in range(count):
            seg = view[i * SEGMENT:(i + 1) * SEGMENT]
            parts.append(aead.encrypt(_nonce(i, i == count - 1), bytes(seg), None))
        return b"".join(parts)

    def open(self, kind: str, name: str, blob: bytes) -> bytes:
        """The plaintext of a sealed object; NotAuthentic if it does not open."""
        if len(blob) < _HEAD + TAG or blob[:len(MAGIC)] != MAGIC:
            raise NotAuthentic("not a sealed object (too short or bad magic)")
        aead = self._aead(kind, name, blob[len(MAGIC):_HEAD])
        body = memoryview(blob)[_HEAD:]
        step = SEGMENT + TAG
        count = max(1, -(-len(body) // step))
        out = []
        for i in range(count):
            seg = body[i * step:(i + 1) * step]
            if len(seg) < TAG:
                raise NotAuthentic("truncated")
            try:
                out.append(aead.decrypt(_nonce(i, i == count - 1), bytes(seg), None))
            except InvalidTag:
                raise NotAuthentic(f"segment {i} does not authenticate") from None
        return b"".join(out)

    # -- streams (packs) ---------------------------------------------------------------------
    def reader(self, kind: str, name: str, path: os.PathLike[str] | str) -> EncryptingReader:
        """A file-like object reading the file at ``path`` sealed (for uploads)."""
        return EncryptingReader(self, kind, name, path)

    def writer(self, kind: str, name: str, out: BinaryIO) -> DecryptingWriter:
        """A file-like object that opens what is written to it into ``out`` (for downloads);
        ``close()`` checks the end (NotAuthentic if the object was truncated)."""
        return DecryptingWriter(self, kind, name, out)


class EncryptingReader:
    """``read(n)`` returns the next bytes of a file sealed as one object (not seekable)."""

    def __init__(self, key: RepoKey, kind: str, name: str, path: os.PathLike[str] | str
                 ) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.size = os.fstat(self._f.fileno()).st_size
        self._count = max(1, -(-self.size // SEGMENT))
        salt = os.urandom(SALT)
        self._aead = key._aead(kind, name, salt)
        self._rest = memoryview(MAGIC + salt)  # sealed, not read yet
        self._next = 0  # next segment to seal

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        parts, have = [self._rest], len(self._rest)
        while (n < 0 or have < n) and self._next < self._count:
            plain = self._f.read(SEGMENT)
            last = self._next == self._count - 1
            if (len(plain) < SEGMENT and not last) or (last and self._f.read(1)):
                raise OSError("the file changed size while being sealed")
            parts.append(memoryview(self._aead.encrypt(_nonce(self._next, last), plain,
                                                       None)))
            have += len(parts[-1])
            self._next += 1
        self._rest = memoryview(b"")
        if 0 <= n < have:  # keep the tail of the last part for the next read
            cut = len(parts[-1]) - (have - n)
            parts[-1], self._rest = parts[-1][:cut], parts[-1][cut:]
        return b"".join(parts)  # the one copy

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> EncryptingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DecryptingWriter:
    """Takes a sealed object's bytes in order and writes its plaintext to ``out``; a
    segment is opened once a following byte shows it is not the last."""

    def __init__(self, key: RepoKey, kind: str, name: str, out: BinaryIO) -> None:
        self._key, self._kind, self._name = key, kind, name
        self._out = out
        self._aead: AESGCM | None = None
        self._buf = bytearray()
        self._next = 0

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:
        self._buf += data  # at most one segment stays buffered
        if self._aead is None:
            if len(self._buf) < _HEAD:
                return len(data)
            if self._buf[:len(MAGIC)] != MAGIC:
                raise NotAuthentic("not a sealed object (bad magic)")
            self._aead = self._key._aead(self._kind, self._name,
                                         bytes(self._buf[len(MAGIC):_HEAD]))
            del self._buf[:_HEAD]
        step = SEGMENT + TAG
        done = 0
        with memoryview(self._buf) as view:
            while len(view) - done > step:
                self._open(view[done:done + step], last=False)
                done += step
        if done:
            del self._buf[:done]
        return len(data)

    def _open(self, seg: memoryview, last: bool) -> None:
        assert self._aead is not None
        try:
            plain = self._aead.decrypt(_nonce(self._next, last), seg, None)
        except InvalidTag:
            raise NotAuthentic(f"segment {self._next} does not authenticate") from None
        self._out.write(plain)
        self._next += 1

    def close(self) -> None:
        """Open the last segment (NotAuthentic when the object ended early)."""
        if self._aead is None or len(self._buf) < TAG:
            raise NotAuthentic("truncated")
        self._open(memoryview(self._buf), last=True)
        self._buf = bytearray()


def random_key() -> bytes:
    """A fresh master key (or key-file secret)."""
    return os.urandom(KEY_BYTES)


__all__ = ["KEY_BYTES", "NotAuthentic", "REPO_ID_BYTES", "RepoKey", "random_key",
           "sealed_size"]
