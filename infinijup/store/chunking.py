"""Chunkers: where a byte stream is cut into chunks.

Three algorithms share one two-phase design so ingest can use all cores:

* ``scan`` (pure function of the bytes, runs in worker threads, vectorized with numpy)
  finds *candidate* chunk ends in one block of the stream;
* ``Splitter`` (sequential, cheap) picks the actual cut points from the candidates with
  FastCDC's normalized-chunking rule: skip ``min_size``, then take the first candidate of
  the *strict* set up to ``normal_size``, else the first of the *loose* set up to
  ``max_size``, else cut at ``max_size``.

Algorithms:

``fastcdc``
    Byte-granular FastCDC. The gear hash ``h = (h << 1) + G[b]`` in uint32 depends on exactly
    the last 32 bytes, so ``h_i = sum_k G[b_{i-k}] << k``; it is computed for every position
    with log2(32) = 5 vectorized shift-and-add passes (prefix doubling) over cache-sized
    sub-blocks. Strict/loose masks take ``log2(avg) +- 2`` of the top bits (NC level 2).
``pagecdc``
    Content-defined at page granularity: cuts fall only on 4 KiB page boundaries, chosen by a
    64-bit fingerprint of words sampled across each page. A CRIU ``pages-*.img`` is a
    concatenation of whole pages, so inserted memory shifts the rest by whole pages and the
    cut points re-synchronise exactly as with byte-granular CDC, at a fraction of the cost.
``fixed``
    Fixed-size chunks (a multiple of the page size) at fixed stream offsets.

The default is chosen by measurement; see docs/store.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import UnsupportedFormat

PAGE = 4096
_SUB = 1 << 16  # fastcdc sub-block: keeps the doubling passes in L2 cache
_WINDOW = 32  # bytes that determine a uint32 gear hash


@dataclass(frozen=True)
class ChunkerParams:
    """Parameters of a chunker; stored in the store's config so every writer cuts alike."""

    algorithm: str = "pagecdc"
    min_size: int = 8 * 1024
    avg_size: int = 32 * 1024
    max_size: int = 128 * 1024
    seed: int = 0x1F1A_B0B5

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for the config file."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkerParams:
        """Parse and validate the config form."""
        try:
            params = cls(**data)
        except TypeError as exc:
            raise UnsupportedFormat(f"bad chunker parameters {data!r}: {exc}") from exc
        params.validate()
        return params

    def validate(self) -> None:
        """Raise UnsupportedFormat unless the parameters make a usable chunker."""
        if self.algorithm not in ALGORITHMS:
            raise UnsupportedFormat(f"unknown chunker {self.algorithm!r}")
        if not (0 < self.min_size <= self.avg_size <= self.max_size):
            raise UnsupportedFormat(f"chunk sizes must satisfy 0 < min <= avg <= max: {self}")
        if self.algorithm == "fastcdc" and self.min_size < _WINDOW:
            raise UnsupportedFormat("fastcdc min_size must be >= 32")
        if self.algorithm in ("pagecdc", "fixed") and any(
            s % PAGE for s in (self.min_size, self.avg_size, self.max_size)
        ):
            raise UnsupportedFormat(f"{self.algorithm} sizes must be multiples of {PAGE}")
        if self.avg_size & (self.avg_size - 1):
            raise UnsupportedFormat("avg_size must be a power of two")


def fixed_params(size: int = 64 * 1024) -> ChunkerParams:
    """Parameters for fixed-size chunks of ``size`` bytes."""
    return ChunkerParams("fixed", size, size, size)


def fastcdc_params(avg: int = 64 * 1024) -> ChunkerParams:
    """Parameters for byte-granular FastCDC with average ``avg`` (min avg/4, max avg*4)."""
    return ChunkerParams("fastcdc", avg // 4, avg, avg * 4)


def pagecdc_params(avg: int = 64 * 1024) -> ChunkerParams:
    """Parameters for page-granular CDC with average ``avg`` (min avg/4, max avg*4)."""
    return ChunkerParams("pagecdc", max(PAGE, avg // 4), avg, avg * 4)


@dataclass(frozen=True)
class Candidates:
    """Candidate chunk ends (absolute stream offsets, sorted) found in one block."""

    strict: np.ndarray
    loose: np.ndarray


_EMPTY = np.empty(0, dtype=np.int64)


class Chunker:
    """Base: fixed-size chunks (no candidates: every cut is at ``max_size``)."""

    overlap = 0  # bytes of preceding stream ``scan`` needs as context

    def __init__(self, params: ChunkerParams) -> None:
        params.validate()
        self.params = params
        self.min_size = params.min_size
        self.normal_size = params.avg_size
        self.max_size = params.max_size

    def scan(self, block: bytes | memoryview, offset: int, context: bytes = b"") -> Candidates:
        """Candidate ends within ``block`` which starts at stream ``offset``.

        ``context`` is up to ``overlap`` bytes of the stream just before the block.
        Pure and thread-safe: blocks may be scanned in parallel.
        """
        return Candidates(_EMPTY, _EMPTY)


class FastCDC(Chunker):
    """Byte-granular FastCDC with a uint32 gear hash over a sliding 32-byte window."""

    overlap = _WINDOW - 1

    def __init__(self, params: ChunkerParams) -> None:
        super().__init__(params)
        rng = np.random.default_rng(params.seed)
        self.gear = rng.integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32)
        bits = params.avg_size.bit_length() - 1
        self.mask_strict = np.uint32(_top_bits(min(bits + 2, 32), 32))
        self.mask_loose = np.uint32(_top_bits(max(bits - 2, 1), 32))

    def scan(self, block: bytes | memoryview, offset: int, context: bytes = b"") -> Candidates:
        data = np.frombuffer(block, dtype=np.uint8)
        n = len(data)
        ctx = np.frombuffer(context[-self.overlap :], dtype=np.uint8) if context else data[:0]
        h = np.empty(_SUB + _WINDOW, dtype=np.uint32)
        tmp = np.empty(_SUB + _WINDOW, dtype=np.uint32)
        strict: list[np.ndarray] = []
        loose: list[np.ndarray] = []
        for start in range(0, n, _SUB):
            if start == 0:
                seg = np.concatenate((ctx, data[:_SUB])) if len(ctx) else data[:_SUB]
                lead = len(ctx)
            else:
                seg = data[start - self.overlap : start + _SUB]
                lead = self.overlap
            m = len(seg)
            hh = h[:m]
            np.take(self.gear, seg, out=hh)
            step = 1
            while step < _WINDOW and step < m:
                np.left_shift(hh[: m - step], step, out=tmp[: m - step])
                np.add(hh[step:], tmp[: m - step], out=hh[step:])
                step *= 2
            hv = hh[lead:]
            base = offset + start + 1  # a hash at index j ends a chunk at j + 1
            loose_idx = np.flatnonzero((hv & self.mask_loose) == 0)
            if len(loose_idx):
                sel = (hv[loose_idx] & self.mask_strict) == 0
                strict.append(loose_idx[sel] + base)
                loose.append(loose_idx + base)
        return Candidates(_cat(strict), _cat(loose))


class PageCDC(Chunker):
    """Content-defined chunking with cut points only on page boundaries."""

    SAMPLE_STRIDE = 16  # sample every 16th 8-byte word: 32 words spread over each page

    def __init__(self, params: ChunkerParams) -> None:
        super().__init__(params)
        rng = np.random.default_rng(params.seed)
        words = PAGE // 8 // self.SAMPLE_STRIDE
        self.keys = rng.integers(1, 2**63, words, dtype=np.uint64) | np.uint64(1)
        bits = max((params.avg_size // PAGE).bit_length() - 1, 1)
        self.mask_strict = np.uint64(_top_bits(bits + 1, 64))
        self.mask_loose = np.uint64(_top_bits(max(bits - 1, 1), 64))

    def fingerprints(self, block: bytes | memoryview) -> np.ndarray:
        """One 64-bit fingerprint per whole page of ``block``."""
        npages = len(block) // PAGE
        words = np.frombuffer(block, dtype="<u8", count=npages * (PAGE // 8))
        sample = words.reshape(npages, PAGE // 8)[:, :: self.SAMPLE_STRIDE]
        with np.errstate(over="ignore"):
            f = (sample * self.keys).sum(axis=1, dtype=np.uint64)
            f ^= f >> np.uint64(31)
            f *= np.uint64(0x9E3779B97F4A7C15)
            f ^= f >> np.uint64(29)
        return f

    def scan(self, block: bytes | memoryview, offset: int, context: bytes = b"") -> Candidates:
        if offset % PAGE:
            raise ValueError("pagecdc blocks must start on a page boundary")
        f = self.fingerprints(block)
        ends = (np.arange(1, len(f) + 1, dtype=np.int64) * PAGE) + offset
        loose = (f & self.mask_loose) == 0
        strict = loose & ((f & self.mask_strict) == 0)
        return Candidates(ends[strict], ends[loose])


ALGORITHMS: dict[str, type[Chunker]] = {"fixed": Chunker, "fastcdc": FastCDC, "pagecdc": PageCDC}


def make_chunker(params: ChunkerParams) -> Chunker:
    """The chunker for ``params``."""
    params.validate()
    return ALGORITHMS[params.algorithm](params)


def _top_bits(count: int, width: int) -> int:
    return ((1 << count) - 1) << (width - count)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return np.concatenate(parts).astype(np.int64, copy=False)


def _first_at_least(arr: list[int], x: int) -> int | None:
    i = bisect.bisect_left(arr, x)
    return arr[i] if i < len(arr) else None


class Splitter:
    """Sequential cut selection over a stream of scanned blocks.

    ``feed`` a block with its ``Candidates`` (in stream order); it returns the chunk ends
    (absolute offsets) it could decide. ``finish`` returns the remaining ends.
    """

    def __init__(self, chunker: Chunker) -> None:
        self.c = chunker
        self.start = 0  # start of the next chunk
        self.avail = 0  # bytes of stream seen
        self.strict: list[int] = []
        self.loose: list[int] = []

    def feed(self, length: int, cands: Candidates) -> list[int]:
        """Account ``length`` more bytes with their candidates; return decided chunk ends."""
        self.strict = _drop_before(self.strict, self.start, cands.strict)
        self.loose = _drop_before(self.loose, self.start, cands.loose)
        self.avail += length
        return self._cuts(final=False)

    def finish(self) -> list[int]:
        """End of stream: return the ends of all remaining chunks."""
        return self._cuts(final=True)

    def _cuts(self, final: bool) -> list[int]:
        ends: list[int] = []
        c = self.c
        while self.avail > self.start:
            start, avail = self.start, self.avail
            cut: int | None = None
            if final and avail - start <= c.min_size:
                cut = avail
            else:
                nrm, hi = start + c.normal_size, start + c.max_size
                s = _first_at_least(self.strict, start + c.min_size)
                if s is not None and s <= nrm and s <= avail:
                    cut = s
                elif nrm > avail:
                    cut = avail if final else None
                else:
                    lo = _first_at_least(self.loose, nrm + 1)
                    if lo is not None and lo <= hi and lo <= avail:
                        cut = lo
                    elif hi > avail:
                        cut = avail if final else None
                    else:
                        cut = hi
            if cut is None:
                break
            ends.append(cut)
            self.start = cut
        return ends


def _drop_before(old: list[int], start: int, new: np.ndarray) -> list[int]:
    kept = old[bisect.bisect_right(old, start) :]
    kept.extend(new.tolist())
    return kept


def chunk_lengths(chunker: Chunker, data: bytes, block_size: int = 8 << 20) -> list[int]:
    """Chunk lengths of ``data`` as a whole (for tests and measurements)."""
    return [b - a for a, b in _pairs(iter_cuts(chunker, _blocks(data, block_size)))]


def iter_cuts(chunker: Chunker, blocks: Iterable[bytes | memoryview]) -> Iterator[int]:
    """Chunk ends of a stream given as blocks (sequential scan; ingest parallelizes it)."""
    sp = Splitter(chunker)
    offset = 0
    prev = b""
    for block in blocks:
        yield from sp.feed(len(block), chunker.scan(block, offset, prev))
        offset += len(block)
        prev = bytes(block[-chunker.overlap :]) if chunker.overlap else b""
    yield from sp.finish()


def _blocks(data: bytes, size: int) -> Iterator[memoryview]:
    mv = memoryview(data)
    for i in range(0, len(data), size):
        yield mv[i : i + size]


def _pairs(ends: Iterable[int]) -> Iterator[tuple[int, int]]:
    prev = 0
    for e in ends:
        yield prev, e
        prev = e
