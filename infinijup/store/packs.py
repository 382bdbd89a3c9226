"""Pack files: many objects in one file, self-describing so the index can be rebuilt.

Layout (modelled on restic)::

    object_0 || object_1 || ... || header || u32le header_length || b"IJPK"

    header = b"IJPH" u8 version u8[3] 0 u32le count
             count x (u8 type, u8 compression, 32-byte id, u64le stored_len, u64le raw_len)
             32-byte BLAKE3 of everything before it in the header

Object offsets are the running sum of the stored lengths. ``id`` is BLAKE3 of the object's
plaintext; ``compression`` is 0 (raw), 1 (zstd) or 2 (a page delta of other chunks, see
delta.py; store format 2). A pack's name is the BLAKE3 of its header
(the header lists every object id and length, so equal names mean equal contents).
Packs are written to ``tmp/``, fsynced, then renamed into ``packs/<xx>/`` and the directory
fsynced: a pack either exists whole or not at all.

In an encrypted store (``key``: a local_crypto.StoreKey) every object is stored sealed (its
stored length counts the 28 bytes of nonce and tag), the header is sealed as a whole (the
trailer's length is the sealed header's), ids are keyed and a pack's name is the keyed id of
its plaintext header.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from . import fsutil
from .errors import ChecksumMismatch, CorruptObject, CorruptPack, ObjectMissing
from .objects import CHUNK, ID_BYTES, TYPE_NAMES, hash_bytes

if TYPE_CHECKING:
    from .local_crypto import StoreKey

RAW, ZSTD, DELTA = 0, 1, 2
COMPRESSIONS = (RAW, ZSTD, DELTA)

TRAILER = struct.Struct("<I4s")
TRAILER_MAGIC = b"IJPK"
HEADER_HEAD = struct.Struct("<4sB3xI")
HEADER_MAGIC = b"IJPH"
ENTRY = struct.Struct("<BB32sQQ")
HEADER_VERSION = 1
MAX_HEADER = HEADER_HEAD.size + 16 * 1024 * 1024 * ENTRY.size  # sanity bound
MAX_RAW = 1 << 34  # no single object is larger than 16 GiB
SEALED = 28  # bytes a sealed object takes more than its payload (local_crypto.OVERHEAD)


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


def parse_header(header: bytes, data_length: int, name: str = "?", overhead: int = 0
                 ) -> list[PackEntry]:
    """Parse a header and check it accounts for exactly ``data_length`` bytes of objects
    (``overhead``: the sealing bytes per object of an encrypted store)."""
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
        if typ not in TYPE_NAMES or comp not in COMPRESSIONS or raw > MAX_RAW:
            raise CorruptPack(f"pack {name}: entry {i} has a bad type/compression/size")
        if comp == RAW and length != raw + overhead:
            raise CorruptPack(f"pack {name}: raw entry {i} has mismatched lengths")
        if comp == DELTA and typ != CHUNK:
            raise CorruptPack(f"pack {name}: entry {i} is a delta but not a chunk")
        entries.append(PackEntry(typ, comp, oid, offset, length, raw))
        offset += length
    if offset != data_length:
        raise CorruptPack(
            f"pack {name}: header lists {offset} bytes of objects but the pack holds {data_length}"
        )
    return entries


def read_pack_entries(path: Path, key: StoreKey | None = None) -> list[PackEntry]:
    """Read and parse the header at the end of the pack file at ``path``."""
    return read_pack_header(path, key)[1]


def read_pack_header(path: Path, key: StoreKey | None = None) -> tuple[bytes, list[PackEntry]]:
    """(raw header, parsed entries) of the pack file at ``path`` (its header opened with
    ``key`` in an encrypted store: the plaintext header is returned)."""
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
    if key is None:
        return header, parse_header(header, size - TRAILER.size - hlen, name)
    try:
        header = key.open_header(header, HEADER_VERSION, name)
    except CorruptObject as exc:
        raise CorruptPack(str(exc)) from None
    return header, parse_header(header, size - TRAILER.size - hlen, name, SEALED)


_local = threading.local()  # zstd contexts are not thread-safe: one per thread


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def decode_payload(payload: bytes, entry_id: bytes, compression: int, raw_length: int,
                   where: str, key: StoreKey | None = None) -> bytes:
    """Decompress and BLAKE3-verify one stored object (its payload opened already, in an
    encrypted store, whose ``key`` makes the id). ``where`` names it in errors.

    Deltas need their sources: read them with ``reader.ObjectReader``."""
    data = decompress_payload(payload, compression, raw_length, where)
    if (hash_bytes(data) if key is None else key.object_id(data)) != entry_id:
        raise ChecksumMismatch(f"{where}: checksum mismatch")
    return data


def decompress_payload(payload: bytes, compression: int, raw_length: int, where: str) -> bytes:
    """The plaintext of a stored (raw or zstd) object, NOT verified: only for callers that
    verify what they build from it (a delta's sources: the rebuilt chunk is verified)."""
    if compression == DELTA:
        raise ValueError(f"{where}: a delta object needs its sources (use ObjectReader)")
    if compression == RAW and len(payload) != raw_length:
        raise ChecksumMismatch(f"{where}: short read")
    if compression == ZSTD:
        try:
            data = _decompressor().decompress(payload, max_output_size=raw_length)
        except zstandard.ZstdError as exc:
            raise ChecksumMismatch(f"{where}: does not decompress ({exc})") from exc
    else:
        data = payload
    if len(data) != raw_length:
        raise ChecksumMismatch(f"{where}: checksum mismatch")
    return data


class PackWriter:
    """Appends objects to a new pack in ``tmp/``; ``finish`` makes it durable and visible.

    The header is kept in columns (one list per field) rather than one ``PackEntry`` per
    object: ingest appends thousands of chunks per pack, and the columns are encoded into the
    header and the index rows in bulk.
    """

    def __init__(self, packs_dir: Path, tmp_dir: Path, *, writeback: bool = True,
                 key: StoreKey | None = None) -> None:
        self.packs_dir = packs_dir
        self.key = key  # an encrypted store's: payloads come sealed, the header is sealed
        self.tmp_path = fsutil.temp_name(tmp_dir, "pack")
        self._fd = fsutil.open_private(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self.types: list[int] = []
        self.compressions: list[int] = []
        self.ids: list[bytes] = []
        self.lengths: list[int] = []
        self.raw_lengths: list[int] = []
        self.size = 0
        self.writeback = writeback
        self.name = ""  # pack id, once finished
        self.total_size = 0  # file size, header included, once finished

    @property
    def count(self) -> int:
        """Number of objects accounted so far."""
        return len(self.ids)

    @property
    def entries(self) -> list[PackEntry]:
        """The objects accounted so far, as header entries (offsets included)."""
        offsets = itertools.accumulate(self.lengths, initial=0)
        return [PackEntry(*e) for e in zip(self.types, self.compressions, self.ids, offsets,
                                           self.lengths, self.raw_lengths, strict=False)]

    def index_rows(self, pid: int) -> Iterator[tuple[bytes, int, int, int, int, int, int]]:
        """Rows of the index's ``objects`` table for every object, for pack row ``pid``."""
        offsets = itertools.accumulate(self.lengths, initial=0)
        return zip(self.ids, itertools.repeat(pid), offsets, self.lengths, self.raw_lengths,
                   self.types, self.compressions, strict=False)

    def add(self, typ: int, oid: bytes, payload: bytes | memoryview, compression: int,
            raw_length: int) -> None:
        """Append one already-encoded object."""
        self.write_at(*self.reserve([(typ, oid, payload, compression, raw_length)]))

    def add_many(self, items: list[tuple[int, bytes, bytes | memoryview, int, int]]) -> None:
        """Append several objects (type, id, payload, compression, raw length)."""
        self.write_at(*self.reserve(items))

    def reserve(self, items: list[tuple[int, bytes, bytes | memoryview, int, int]]
                ) -> tuple[list[bytes | memoryview], int]:
        """Account objects (type, id, payload, compression, raw length) in the header;
        returns (payloads, file offset) for ``write_at``, which must have written them
        (possibly from another thread) before ``finish``."""
        if not items:
            return [], self.size
        types, ids, payloads, comps, raws = zip(*items, strict=True)
        return self.reserve_columns(types, ids, payloads, comps, raws)

    def reserve_columns(self, types: Sequence[int], ids: Sequence[bytes],
                        payloads: Sequence[bytes | memoryview], compressions: Sequence[int],
                        raw_lengths: Sequence[int]) -> tuple[list[bytes | memoryview], int]:
        """``reserve`` for objects given as columns (equal-length sequences)."""
        lengths = list(map(len, payloads))
        offset = self.size
        self.types += types
        self.ids += ids
        self.compressions += compressions
        self.raw_lengths += raw_lengths
        self.lengths += lengths
        self.size += sum(lengths)
        return list(payloads), offset

    def write_at(self, payloads: Sequence[bytes | memoryview], offset: int) -> None:
        """Write payloads accounted by ``reserve`` at the offset it returned. Writes of
        different reservations may run concurrently, from any threads."""
        end = pwritev_all(self._fd, payloads, offset)
        if self.writeback:
            fsutil.start_writeback(self._fd, offset, end - offset)

    def finish(self) -> tuple[str, Path, int]:
        """Write header and trailer, fsync, rename into place. Returns (id, path, size).
        Every reserved payload must have been written."""
        header = encode_header_columns(self.types, self.compressions, self.ids, self.lengths,
                                       self.raw_lengths)
        stored = header if self.key is None else self.key.seal_header(header, HEADER_VERSION)
        tail = stored + TRAILER.pack(len(stored), TRAILER_MAGIC)
        pwritev_all(self._fd, [tail], self.size)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        pack_id = (hash_bytes(header) if self.key is None else self.key.object_id(header)).hex()
        final = pack_path(self.packs_dir, pack_id)
        fsutil.make_private_dir(final.parent)
        os.replace(self.tmp_path, final)
        fsutil.fsync_dir(final.parent)
        self.name, self.total_size = pack_id, self.size + len(tail)
        return pack_id, final, self.total_size

    def abort(self) -> None:
        """Drop the unfinished pack."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass


_ENTRY_DTYPE = np.dtype([("type", "u1"), ("compression", "u1"), ("id", "V32"),
                         ("length", "<u8"), ("raw_length", "<u8")])
assert _ENTRY_DTYPE.itemsize == ENTRY.size


def encode_header_columns(types: Sequence[int], compressions: Sequence[int],
                          ids: Sequence[bytes], lengths: Sequence[int],
                          raw_lengths: Sequence[int]) -> bytes:
    """``encode_header`` for entries given as columns; the same bytes, built in bulk."""
    n = len(ids)
    table = np.empty(n, dtype=_ENTRY_DTYPE)
    if n:
        table["type"] = types
        table["compression"] = compressions
        table["id"] = np.frombuffer(b"".join(ids), dtype="V32")
        table["length"] = lengths
        table["raw_length"] = raw_lengths
    body = HEADER_HEAD.pack(HEADER_MAGIC, HEADER_VERSION, n) + table.tobytes()
    return body + hash_bytes(body)


def pwritev_all(fd: int, payloads: Sequence[bytes | memoryview], offset: int) -> int:
    """Write every payload, in order, from file ``offset`` on, with as few ``pwritev`` calls
    as the OS allows (IOV_MAX buffers each; short writes are resumed). Returns the end."""
    for i in range(0, len(payloads), _IOV_MAX):
        views = payloads[i : i + _IOV_MAX]
        want = sum(map(len, views))
        n = os.pwritev(fd, views, offset)
        if n != want:  # short write (rare: signals, full disks): finish it piece by piece
            rest = n
            for v in views:
                v = memoryview(v).cast("B")
                if rest >= len(v):
                    rest -= len(v)
                    continue
                pos = offset + n
                v, rest = v[rest:], 0
                while v:
                    k = os.pwrite(fd, v, pos)
                    v, pos, n = v[k:], pos + k, n + k
        offset += want
    return offset


_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def pack_path(packs_dir: Path, pack_id: str) -> Path:
    """Where the pack named ``pack_id`` lives."""
    return packs_dir / pack_id[:2] / pack_id


class PackFiles:
    """Read-only descriptors of a store's packs, each opened on first use and kept until
    ``close`` (thread-safe)."""

    def __init__(self, packs_dir: Path) -> None:
        self.packs_dir = packs_dir
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, pack: str) -> int:
        """An open descriptor of pack ``pack`` (ObjectMissing if there is no such file)."""
        with self._lock:
            fd = self._fds.get(pack)
            if fd is None:
                try:
                    fd = os.open(pack_path(self.packs_dir, pack), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise ObjectMissing(f"pack {pack} is missing") from None
                self._fds[pack] = fd
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
