"""Reading single objects back from packs, verified, page deltas included.

``ObjectReader`` keeps pack files open and one zstd context per thread; it is shared by
``Repository.read_object``, checkout (for delta chunks), ``check --read-data``, gc's
repacking, the writer (which reads a parent's chunks to build deltas) and the restore that
serves page files from the store (engine/store_pages.py). Every plaintext it returns has been
verified against its id: in a plain store by its BLAKE3; in an encrypted store by opening it
(its AES-GCM tag binds the keyed id, type and compression) and its length, as checkout does
(docs/store.md says why no keyed re-hash is needed; ``check --read-data`` still makes one).
A rebuilt delta chunk is hashed as a whole in both, its sources read without hashing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import zstandard

from . import delta
from .errors import ChecksumMismatch, CorruptObject, ObjectMissing
from .index import Location
from .objects import hash_bytes
from .packs import DELTA, PackFiles, decode_payload, decompress_payload

if TYPE_CHECKING:
    from .repo_view import RepoView

#: Sources are stored whole, so a delta needs one level; more only after an index rebuild
#: chose odd duplicates. The bound stops a damaged store from recursing without end.
MAX_DEPTH = 4


class ObjectReader:
    """Verified object reads from one store's packs (thread-safe)."""

    def __init__(self, repo: RepoView) -> None:
        self.repo = repo
        self._packs = PackFiles(repo.packs_dir)
        self._local = threading.local()

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the pack files."""
        self._packs.close()

    def pack_fd(self, pack: str) -> int:
        """An open descriptor of pack ``pack`` (kept until close)."""
        return self._packs.fd(pack)

    def dctx(self) -> zstandard.ZstdDecompressor:
        """This thread's zstd decompression context."""
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor()
        return d

    def locate(self, oid: bytes) -> Location:
        """Where ``oid`` is stored (ObjectMissing if not indexed)."""
        loc = self.repo.index.lookup(oid)
        if loc is None:
            raise ObjectMissing(f"object {oid.hex()} is not in the index")
        return loc

    def payload(self, oid: bytes, loc: Location) -> bytes:
        """The stored bytes of an object (not verified; in an encrypted store, opened:
        authenticated, still compressed)."""
        data = os.pread(self.pack_fd(loc.pack), loc.length, loc.offset)
        if len(data) != loc.length:
            raise ChecksumMismatch(f"object {oid.hex()} in pack {loc.pack}: short read")
        return data if self.repo.key is None else self.open(oid, loc, data)

    def open(self, oid: bytes, loc: Location, sealed: bytes | memoryview) -> bytes:
        """The payload of an encrypted store's object from its sealed bytes (ChecksumMismatch
        if they do not authenticate)."""
        try:
            return self.repo.key.open(oid, loc.type, loc.compression, sealed)
        except CorruptObject as exc:
            raise ChecksumMismatch(f"{exc} (in pack {loc.pack})") from None

    def read(self, oid: bytes, loc: Location | None = None, *, _depth: int = 0) -> bytes:
        """The verified plaintext of ``oid`` (located by the index unless ``loc`` is given).

        Raises ObjectMissing (not indexed, pack gone, delta source gone) or
        ChecksumMismatch (damaged bytes anywhere, naming the object and its pack).
        """
        if loc is None:
            loc = self.locate(oid)
        payload = self.payload(oid, loc)
        where = f"object {oid.hex()} in pack {loc.pack}"
        if loc.compression != DELTA:
            if self.repo.key is not None:  # opened: its tag verified it, the length is checked
                return decompress_payload(payload, loc.compression, loc.raw_length, where)
            return decode_payload(payload, oid, loc.compression, loc.raw_length, where)
        return bytes(self.rebuild(oid, loc, payload, _depth))

    def rebuild(self, oid: bytes, loc: Location, payload: bytes, depth: int = 0, *,
                locations: Mapping[bytes, Location] | None = None,
                cache: dict[bytes, bytes] | None = None,
                parsed: delta.Delta | None = None) -> bytes | bytearray:
        """The verified plaintext of the delta object ``oid`` stored as ``payload``.

        ``locations``: where sources are, if the caller looked them up already (one query
        for many deltas); ``cache``: source plaintexts to reuse and fill; ``parsed``: the
        payload, parsed. Sources are read without hashing them: the rebuilt chunk is
        verified, and only if that fails are the sources verified, to name the damage.
        """
        where = f"object {oid.hex()} in pack {loc.pack}"
        if depth >= MAX_DEPTH:
            raise ChecksumMismatch(f"{where}: delta sources nest deeper than {MAX_DEPTH}")

        def source(sid: bytes) -> bytes:
            if cache is not None and sid in cache:
                return cache[sid]
            try:
                sloc = (locations.get(sid) if locations else None) or self.locate(sid)
                data = self._plain(sid, sloc, depth + 1)
            except ObjectMissing as exc:
                raise ObjectMissing(f"{where}: delta source {sid.hex()}: {exc}") from exc
            if cache is not None:
                cache[sid] = data
            return data

        try:
            if parsed is None:
                parsed = delta.parse(payload, loc.raw_length)
            data = delta.apply(payload, loc.raw_length, source, self.dctx(), parsed)
        except CorruptObject as exc:
            raise ChecksumMismatch(f"{where}: damaged delta ({exc})") from exc
        key = self.repo.key
        if (hash_bytes(data) if key is None else key.object_id(data)) != oid:
            for sid in parsed.sources:  # a damaged source names itself
                if cache is not None:
                    cache.pop(sid, None)
                self.read(sid, locations.get(sid) if locations else None, _depth=depth + 1)
            raise ChecksumMismatch(f"{where}: checksum mismatch")
        return data

    def _plain(self, oid: bytes, loc: Location, depth: int) -> bytes:
        """The plaintext of a delta source, not verified (see rebuild)."""
        payload = self.payload(oid, loc)
        if loc.compression == DELTA:
            return bytes(self.rebuild(oid, loc, payload, depth))
        return decompress_payload(payload, loc.compression, loc.raw_length,
                                  f"object {oid.hex()} in pack {loc.pack}")

    def delta_header(self, oid: bytes, loc: Location) -> delta.Delta:
        """The parsed header (sources and runs) of the delta object ``oid``; reads only the
        header's bytes."""
        if self.repo.key is not None:  # sealed: read and open it whole
            try:
                payload = self.payload(oid, loc)
                return delta.parse(payload[:delta.header_size(payload)])
            except CorruptObject as exc:
                raise ChecksumMismatch(
                    f"object {oid.hex()} in pack {loc.pack}: damaged delta ({exc})") from exc
        fd = self.pack_fd(loc.pack)
        head = os.pread(fd, min(loc.length, 4096), loc.offset)
        try:
            need = delta.header_size(head)
            if need > loc.length:
                raise CorruptObject("delta header runs past the object")
            if need > len(head):
                head = os.pread(fd, need, loc.offset)
            return delta.parse(head[:need])
        except CorruptObject as exc:
            raise ChecksumMismatch(
                f"object {oid.hex()} in pack {loc.pack}: damaged delta ({exc})") from exc

    def sources(self, oid: bytes, loc: Location) -> list[bytes]:
        """The source chunk ids of the delta object ``oid`` (reads only its header)."""
        return self.delta_header(oid, loc).sources
