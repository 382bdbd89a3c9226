"""Page deltas: a chunk stored as pages of other chunks plus its new pages.

When a snapshot changes a few pages of a 32 KiB chunk, the chunk gets a new id and would be
stored whole. A *page delta* stores it as a recipe instead: byte runs copied from *source*
chunks (chunks of the parent snapshot, stored whole), runs of zeros, and the *literal*
bytes that match nothing (the changed pages), zstd-compressed where that pays.

The delta is a stored encoding of a chunk, like zstd: the chunk keeps its id (BLAKE3 of its
plaintext), blobs list it as before, and every read rebuilds the plaintext and checks that
hash. Pack headers mark it with compression ``DELTA``. Sources are always chunks stored
whole (never deltas themselves), so reading a delta costs at most one level of extra reads.

Encoding (little-endian)::

    b"IJD1" u8 flags u8 0 u16 nsrc u32 nruns u32 literal_length
    nsrc  x 32-byte source chunk id
    nruns x (u16 src, u16 0, u32 length, u32 source_offset)
    16 bytes: BLAKE3 of all of the above, truncated
    literals: literal_length bytes, raw, or one zstd frame if flags & 1

``src`` indexes the source list; ``LITERAL`` takes the next bytes of the literals, ``ZEROS``
is a run of zero bytes. The runs' lengths add up to the chunk's raw length. The header's own
checksum makes a damaged header (say, a flipped byte in a source id) read as damage, not as
a missing source; damaged literals show when the rebuilt chunk is hashed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import zstandard

from .errors import CorruptObject
from .objects import ID_BYTES, hash_bytes

MAGIC = b"IJD1"
HEAD = struct.Struct("<4sBxHII")
RUN = struct.Struct("<HxxII")
LITERAL, ZEROS = 0xFFFF, 0xFFFE
MAX_SOURCES = 0xFFF0
FLAG_ZSTD = 1
DIGEST = 16  # bytes of the header checksum
#: A chunk is stored as a delta only when at most this share of it is literal bytes.
MAX_LITERAL_SHARE = 0.5

#: (src, length, source offset): one run of a delta; ``src`` may be LITERAL or ZEROS.
Run = tuple[int, int, int]


@dataclass(frozen=True)
class Delta:
    """A parsed delta payload."""

    sources: list[bytes]
    runs: list[Run]
    zstd: bool
    literal_length: int
    literal_at: int  # offset of the literal section in the payload


def header_size(payload_prefix: bytes) -> int:
    """Bytes of payload needed to parse the header (sources and runs), from its first
    ``HEAD.size`` bytes."""
    if len(payload_prefix) < HEAD.size:
        raise CorruptObject("delta too short")
    magic, _flags, nsrc, nruns, _lit = HEAD.unpack_from(payload_prefix)
    if magic != MAGIC:
        raise CorruptObject("delta has a bad magic")
    return HEAD.size + nsrc * ID_BYTES + nruns * RUN.size + DIGEST


def encode(sources: list[bytes], runs: list[Run], literals: bytes, zstd: bool,
           literal_length: int) -> bytes:
    """A delta payload; ``literals`` is the literal section as stored (zstd or raw)."""
    if len(sources) > MAX_SOURCES:
        raise ValueError("too many delta sources")
    parts = [HEAD.pack(MAGIC, FLAG_ZSTD if zstd else 0, len(sources), len(runs),
                       literal_length)]
    parts += sources
    parts += [RUN.pack(s, n, o) for s, n, o in runs]
    header = b"".join(parts)
    return b"".join((header, hash_bytes(header)[:DIGEST], literals))


def parse(payload: bytes | memoryview, raw_length: int | None = None) -> Delta:
    """Parse a delta payload (or, with ``raw_length`` None, at least its header).

    Checks the structure: runs add up to ``raw_length``, every source index exists,
    literal runs add up to the literal length. Raises CorruptObject.
    """
    need = header_size(bytes(payload[: HEAD.size]))
    if len(payload) < need:
        raise CorruptObject("delta header is truncated")
    _magic, flags, nsrc, nruns, lit_len = HEAD.unpack_from(payload)
    if hash_bytes(payload[: need - DIGEST])[:DIGEST] != bytes(payload[need - DIGEST : need]):
        raise CorruptObject("delta header checksum mismatch")
    if flags & ~FLAG_ZSTD:
        raise CorruptObject("delta has unknown flags")
    pos = HEAD.size
    sources = [bytes(payload[pos + i * ID_BYTES : pos + (i + 1) * ID_BYTES])
               for i in range(nsrc)]
    pos += nsrc * ID_BYTES
    runs = list(RUN.iter_unpack(payload[pos : pos + nruns * RUN.size]))
    total = literal = 0
    for src, n, _off in runs:
        if src not in (LITERAL, ZEROS) and src >= nsrc:
            raise CorruptObject("delta run names a source it does not list")
        if n == 0:
            raise CorruptObject("delta has an empty run")
        total += n
        if src == LITERAL:
            literal += n
    if literal != lit_len:
        raise CorruptObject("delta literal runs do not match its literal length")
    if raw_length is not None and total != raw_length:
        raise CorruptObject(f"delta runs hold {total} bytes, not {raw_length}")
    if not (flags & FLAG_ZSTD) and raw_length is not None and len(payload) - need != lit_len:
        raise CorruptObject("delta literal section has the wrong length")
    return Delta(sources, runs, bool(flags & FLAG_ZSTD), lit_len, need)


def apply(payload: bytes | memoryview, raw_length: int,
          source: Callable[[bytes], bytes | memoryview],
          dctx: zstandard.ZstdDecompressor, parsed: Delta | None = None) -> bytearray:
    """Rebuild the plaintext of a delta (not verified: the caller hashes it).

    ``source(id)`` returns a source's plaintext; ``parsed`` is ``parse(payload,
    raw_length)`` if the caller has it. Raises CorruptObject on a malformed delta (runs out
    of a source's range, literals that do not decompress).
    """
    d = parsed if parsed is not None else parse(payload, raw_length)
    lit = memoryview(payload)[d.literal_at :]
    if d.zstd:
        try:
            literals: bytes | memoryview = dctx.decompress(lit, max_output_size=d.literal_length)
        except zstandard.ZstdError as exc:
            raise CorruptObject(f"delta literals do not decompress ({exc})") from exc
        if len(literals) != d.literal_length:
            raise CorruptObject("delta literals have the wrong length")
    else:
        literals = lit
    out = bytearray(raw_length)
    view = memoryview(out)
    plain: dict[int, bytes | memoryview] = {}
    pos = lpos = 0
    for src, n, off in d.runs:
        if src == LITERAL:
            view[pos : pos + n] = literals[lpos : lpos + n]
            lpos += n
        elif src != ZEROS:  # zeros: bytearray() is zero-filled already
            data = plain.get(src)
            if data is None:
                data = plain[src] = source(d.sources[src])
            if off + n > len(data):
                raise CorruptObject("delta run reads past the end of its source")
            view[pos : pos + n] = memoryview(data)[off : off + n]
        pos += n
    return out
