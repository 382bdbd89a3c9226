"""Pack files: many objects in one file, self-describing so the index can be rebuilt.

Layout (modelled on restic)::

    object_0 || object_1 || ... || header || u32le header_length || b"IJPK"

    header = b"IJPH" u8 version u8[3] 0 u32le count
             count x (u8 type, u8 compression, 32-byte id, u64le stored_len, u64le raw_len)
             32-byte BLAKE3 of everything before it in the header

Object offsets are the running sum of the stored lengths. ``id`` is BLAKE3 of the object's
plaintext; ``compression`` is 0 (raw) or 1 (zstd). A pack's name is the BLAKE3 of its header
(the header lists every object id and length, so equal names mean equal contents).
Packs are written to ``tmp/``, fsynced, then renamed into ``packs/<xx>/`` and the directory
fsynced: a pack either exists whole or not at all.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import zstandard

from . import fsutil
from .errors import ChecksumMismatch, CorruptPack, ObjectMissing
from .objects import ID_BYTES, TYPE_NAMES, hash_bytes

RAW, ZSTD = 0, 1

TRAILER = struct.Struct("<I4s")
TRAILER_MAGIC = b"IJPK"
HEADER_HEAD = struct.Struct("<4sB3xI")
HEADER_MAGIC = b"IJPH"
ENTRY = struct.Struct("<BB32sQQ")
HEADER_VERSION = 1
MAX_HEADER = HEADER_HEAD.size + 16 * 1024 * 1024 * ENTRY.size  # sanity bound
MAX_RAW = 1 << 34  # no single object is larger than 16 GiB


@dataclass(frozen=True)
class PackEntry:
    """One object as listed in a pack header."""

    type: int
    compression: int
    id: bytes
    offset: int
    length: int
    raw_length: int


def encode_header(entries: list[PackEntry]) -> bytes:
    """The header (without trailer) describing ``entries`` in file order."""
    parts = [HEADER_HEAD.pack(HEADER_MAGIC, HEADER_VERSION, len(entries))]
    parts += [ENTRY.pack(e.type, e.compression, e.id, e.length, e.raw_length) for e in entries]
    body = b"".join(parts)
    return body + hash_bytes(body)


def parse_header(header: bytes, data_length: int, name: str = "?") -> list[PackEntry]:
    """Parse a header and check it accounts for exactly ``data_length`` bytes of objects."""
    if len(header) < HEADER_HEAD.size + ID_BYTES:
        raise CorruptPack(f"pack {name}: header too short")
    body, digest = header[:-ID_BYTES], header[-ID_BYTES:]
    if hash_bytes(body) != digest:
        raise CorruptPack(f"pack {name}: header checksum mismatch")
    magic, version, count = HEADER_HEAD.unpack_from(body)
    if magic != HEADER_MAGIC or version != HEADER_VERSION:
        raise CorruptPack(f"pack {name}: bad header magic or version")
    if len(body) != HEADER_HEAD.size + count * ENTRY.size:
        raise CorruptPack(f"pack {name}: header length does not match its entry count")
    entries: list[PackEntry] = []
    offset = 0
    for i in range(count):
        typ, comp, oid, length, raw = ENTRY.unpack_from(body, HEADER_HEAD.size + i * ENTRY.size)
        if typ not in TYPE_NAMES or comp not in (RAW, ZSTD) or raw > MAX_RAW:
            raise CorruptPack(f"pack {name}: entry {i} has a bad type/compression/size")
        if comp == RAW and length != raw:
            raise CorruptPack(f"pack {name}: raw entry {i} has mismatched lengths")
        entries.append(PackEntry(typ, comp, oid, offset, length, raw))
        offset += length
    if offset != data_length:
        raise CorruptPack(
            f"pack {name}: header lists {offset} bytes of objects but the pack holds {data_length}"
        )
    return entries


def read_pack_entries(path: Path) -> list[PackEntry]:
    """Read and parse the header at the end of the pack file at ``path``."""
    return read_pack_header(path)[1]


def read_pack_header(path: Path) -> tuple[bytes, list[PackEntry]]:
    """(raw header, parsed entries) of the pack file at ``path``."""
    name = path.name
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < TRAILER.size:
                raise CorruptPack(f"pack {name}: truncated (no trailer)")
            f.seek(size - TRAILER.size)
            hlen, magic = TRAILER.unpack(f.read(TRAILER.size))
            if magic != TRAILER_MAGIC:
                raise CorruptPack(f"pack {name}: bad trailer magic (truncated or damaged)")
            if hlen > min(size - TRAILER.size, MAX_HEADER):
                raise CorruptPack(f"pack {name}: header length {hlen} out of range")
            f.seek(size - TRAILER.size - hlen)
            header = f.read(hlen)
    except FileNotFoundError as exc:
        raise ObjectMissing(f"pack {name} is missing") from exc
    return header, parse_header(header, size - TRAILER.size - hlen, name)


_local = threading.local()  # zstd contexts are not thread-safe: one per thread


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def decode_payload(payload: bytes, entry_id: bytes, compression: int, raw_length: int,
                   where: str) -> bytes:
    """Decompress and BLAKE3-verify one stored object. ``where`` names it in errors."""
    if compression == RAW and len(payload) != raw_length:
        raise ChecksumMismatch(f"{where}: short read")
    if compression == ZSTD:
        try:
            data = _decompressor().decompress(payload, max_output_size=raw_length)
        except zstandard.ZstdError as exc:
            raise ChecksumMismatch(f"{where}: does not decompress ({exc})") from exc
    else:
        data = payload
    if len(data) != raw_length or hash_bytes(data) != entry_id:
        raise ChecksumMismatch(f"{where}: checksum mismatch")
    return data


class PackWriter:
    """Appends objects to a new pack in ``tmp/``; ``finish`` makes it durable and visible."""

    def __init__(self, packs_dir: Path, tmp_dir: Path) -> None:
        self.packs_dir = packs_dir
        self.tmp_path = fsutil.temp_name(tmp_dir, "pack")
        self._fd = fsutil.open_private(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self.entries: list[PackEntry] = []
        self.size = 0

    def add(self, typ: int, oid: bytes, payload: bytes | memoryview, compression: int,
            raw_length: int) -> None:
        """Append one already-encoded object."""
        view = memoryview(payload)
        length = len(view)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.entries.append(PackEntry(typ, compression, oid, self.size, length, raw_length))
        self.size += length

    def add_many(self, items: list[tuple[int, bytes, bytes | memoryview, int, int]]) -> None:
        """Append several objects (type, id, payload, compression, raw length) with writev."""
        self.write(self.reserve(items))

    def reserve(self, items: list[tuple[int, bytes, bytes | memoryview, int, int]]
                ) -> list[memoryview]:
        """Account objects in the header; the caller must then ``write`` the returned
        payloads, in order (possibly from another thread), before ``finish``."""
        for typ, oid, payload, comp, raw in items:
            length = len(payload)
            self.entries.append(PackEntry(typ, comp, oid, self.size, length, raw))
            self.size += length
        return [memoryview(p) for _, _, p, _, _ in items]

    def write(self, views: list[memoryview]) -> None:
        """Write payloads accounted by ``reserve``."""
        for i in range(0, len(views), 512):
            _writev_all(self._fd, views[i : i + 512])

    def finish(self) -> tuple[str, Path, int]:
        """Write header and trailer, fsync, rename into place. Returns (id, path, size)."""
        header = encode_header(self.entries)
        tail = header + TRAILER.pack(len(header), TRAILER_MAGIC)
        os.write(self._fd, tail)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        pack_id = hash_bytes(header).hex()
        final = pack_path(self.packs_dir, pack_id)
        fsutil.make_private_dir(final.parent)
        os.replace(self.tmp_path, final)
        fsutil.fsync_dir(final.parent)
        return pack_id, final, self.size + len(tail)

    def abort(self) -> None:
        """Drop the unfinished pack."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def pack_path(packs_dir: Path, pack_id: str) -> Path:
    """Where the pack named ``pack_id`` lives."""
    return packs_dir / pack_id[:2] / pack_id
