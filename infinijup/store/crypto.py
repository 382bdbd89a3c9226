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
sealed and opened a group of segments at a time (``SegmentSealer``, ``SegmentOpener``: parts
uploaded and ranges fetched in parallel), never held whole in memory.
"""

from __future__ import annotations

import os

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"IJE1"
SALT = 24
TAG = 16
SEGMENT = 1 << 20  # plaintext bytes per sealed segment
KEY_BYTES = 32
REPO_ID_BYTES = 16
HEAD = len(MAGIC) + SALT  # magic and salt, before the first segment
STEP = SEGMENT + TAG  # sealed bytes per full segment
_CONTEXT = "infinijup remote 2026-11 {} key"


class NotAuthentic(Exception):
    """A sealed object does not open: damaged, truncated, renamed, or not this repository's
    (callers say which object, and refuse it)."""


def sealed_size(n: int) -> int:
    """The size of a sealed object of ``n`` plaintext bytes."""
    return HEAD + n + TAG * segments_of(n)


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
        count = segments_of(len(data))
        parts = [MAGIC, salt]
        for i in range(count):
            seg = view[i * SEGMENT:(i + 1) * SEGMENT]
            parts.append(aead.encrypt(_nonce(i, i == count - 1), bytes(seg), None))
        return b"".join(parts)

    def open(self, kind: str, name: str, blob: bytes) -> bytes:
        """The plaintext of a sealed object; NotAuthentic if it does not open."""
        if len(blob) < HEAD + TAG or blob[:len(MAGIC)] != MAGIC:
            raise NotAuthentic("not a sealed object (too short or bad magic)")
        aead = self._aead(kind, name, blob[len(MAGIC):HEAD])
        body = memoryview(blob)[HEAD:]
        count = max(1, -(-len(body) // STEP))
        out = []
        for i in range(count):
            seg = body[i * STEP:(i + 1) * STEP]
            if len(seg) < TAG:
                raise NotAuthentic("truncated")
            try:
                out.append(aead.decrypt(_nonce(i, i == count - 1), bytes(seg), None))
            except InvalidTag:
                raise NotAuthentic(f"segment {i} does not authenticate") from None
        return b"".join(out)

    # -- streams (packs) ---------------------------------------------------------------------
    def sealer(self, kind: str, name: str) -> SegmentSealer:
        """Seals the segments of a new object ``name`` of ``kind``, with a fresh salt (for
        uploads)."""
        return SegmentSealer(self, kind, name)

    def opener(self, kind: str, name: str, head: bytes) -> SegmentOpener:
        """Opens the segments of the sealed object ``name`` whose first ``HEAD`` bytes are
        ``head`` (for downloads)."""
        return SegmentOpener(self, kind, name, head)


class SegmentSealer:
    """Seals the segments of one object in any order (for uploads that send parts of it in
    parallel): the object is ``head`` (``HEAD`` bytes) then segment 0, 1, ... of ``count``;
    segment ``i`` holds the plaintext at ``i * SEGMENT``."""

    def __init__(self, key: RepoKey, kind: str, name: str) -> None:
        salt = os.urandom(SALT)
        self.head = MAGIC + salt
        self._aead = key._aead(kind, name, salt)

    def seal(self, i: int, count: int, plain: bytes | memoryview) -> bytes:
        """Segment ``i`` of ``count`` sealed (``SEGMENT`` plaintext bytes, the last at most
        that)."""
        return self._aead.encrypt(_nonce(i, i == count - 1), plain, None)

    def seal_into(self, i: int, count: int, plain: bytes | memoryview, out: memoryview
                  ) -> None:
        """``seal``, written into ``out`` (``len(plain) + TAG`` bytes)."""
        self._aead.encrypt_into(_nonce(i, i == count - 1), plain, None, out)


class SegmentOpener:
    """Opens the segments of one sealed object in any order (for downloads that fetch
    ranges of it in parallel): made from the object's first ``HEAD`` bytes; segment ``i``
    of ``count`` (``segment_count``) starts at ``HEAD + i * STEP`` and its plaintext at
    ``i * SEGMENT``. Which segment is the last comes from the object's size, so a
    truncated object fails on its (no longer marked) last segment."""

    def __init__(self, key: RepoKey, kind: str, name: str, head: bytes) -> None:
        if len(head) < HEAD or head[:len(MAGIC)] != MAGIC:
            raise NotAuthentic("not a sealed object (too short or bad magic)")
        self._aead = key._aead(kind, name, bytes(head[len(MAGIC):HEAD]))

    def open(self, i: int, count: int, seg: bytes | memoryview) -> bytes:
        """The plaintext of segment ``i`` of ``count``; NotAuthentic if it does not open."""
        if len(seg) < TAG:
            raise NotAuthentic("truncated")
        try:
            return self._aead.decrypt(_nonce(i, i == count - 1), seg, None)
        except InvalidTag:
            raise NotAuthentic(f"segment {i} does not authenticate") from None


def segment_count(sealed: int) -> int:
    """How many segments a sealed object of ``sealed`` bytes has (NotAuthentic when no
    sealed object has that size: cut inside a header or a tag)."""
    body = sealed - HEAD
    count = max(1, -(-body // STEP))
    if body < TAG or body - (count - 1) * STEP < TAG:
        raise NotAuthentic("truncated")
    return count


def segments_of(plain: int) -> int:
    """How many segments an object of ``plain`` plaintext bytes is sealed in."""
    return max(1, -(-plain // SEGMENT))


def plain_size(sealed: int) -> int:
    """The plaintext size of a sealed object of ``sealed`` bytes."""
    return sealed - HEAD - TAG * segment_count(sealed)


def random_key() -> bytes:
    """A fresh master key (or key-file secret)."""
    return os.urandom(KEY_BYTES)


__all__ = ["HEAD", "KEY_BYTES", "NotAuthentic", "REPO_ID_BYTES", "STEP", "RepoKey",
           "SegmentOpener", "SegmentSealer", "plain_size", "random_key", "sealed_size",
           "segment_count", "segments_of"]
