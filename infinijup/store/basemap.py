"""Finding page deltas: a parent file's page map, and the delta of a new chunk against it.

A snapshot's ``pages-*.img`` is mostly its parent's: CDC finds the unchanged chunks by id,
and a chunk with a few changed pages is new. ``BaseMap`` says, for every page of the
parent's version of the file, which chunk stored *whole* holds it and where (pages of a
parent chunk that is itself a delta point into that delta's sources; its literal pages
are not used, so deltas never nest). ``BaseMap.encode`` compares each page of a new chunk
with the parent's page at the same position (after the shift that the neighbouring
unchanged chunks show) and, if at most half of the chunk is new bytes, returns the delta
payload (delta.py).

Only ingest after a first snapshot pays for this, and only for new chunks: the page map is
built once per file (one index query), and a new chunk costs reading its one or two source
chunks (verified) and comparing pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from . import delta
from .chunking import PAGE
from .errors import StoreError
from .index import Location
from .packs import DELTA

if TYPE_CHECKING:
    from .reader import ObjectReader
    from .repository import Repository

_SLICE = 1 << 20  # pages mapped per numpy pass (bounds temporary memory)
NEIGHBOURS = 8  # chunks looked at on each side of a new chunk for an unchanged one
# When the file has little in common with its parent, trying costs reads for nothing: after
# TRIAL attempts, if fewer than 1 in HIT_RATE succeed, only every SPARSE-th chunk is tried.
TRIAL, HIT_RATE, SPARSE = 64, 8, 16


class BaseMap:
    """Where each page of a parent file is stored whole (see module docs)."""

    def __init__(self, src_ids: list[bytes], src_locs: list[Location], page_src: np.ndarray,
                 page_off: np.ndarray, anchors: dict[bytes, tuple[int, int]]) -> None:
        self.src_ids = src_ids
        self.src_locs = src_locs
        self.page_src = page_src  # int32 per parent page: index into src_ids, -1: none
        self.page_off = page_off  # int64: offset of the page in that source
        self.anchors = anchors  # chunk id -> (start, end) in the parent, for unique ids
        self.tried = 0  # counters shared by the worker threads (approximate is enough)
        self.hits = 0
        self.skipped = 0

    @classmethod
    def build(cls, repo: Repository, reader: ObjectReader, blob_id: str) -> BaseMap | None:
        """The page map of the stored file ``blob_id``, or None if it cannot be read."""
        try:
            size, ids = repo.get_blob_chunks(blob_id)
            locs = repo.index.lookup_many(ids)
            if len(locs) < len(set(ids)) or size < PAGE:
                return None
            n = len(ids)
            lens = np.fromiter((locs[c].raw_length for c in ids), np.int64, n)
            whole = np.fromiter((locs[c].compression != DELTA for c in ids), np.bool_, n)
            ends = np.cumsum(lens)
            starts = ends - lens
            npages = size // PAGE
            page_src = np.full(npages, -1, dtype=np.int32)
            page_off = np.zeros(npages, dtype=np.int64)
            for k0 in range(0, npages, _SLICE):
                q = np.arange(k0, min(k0 + _SLICE, npages), dtype=np.int64) * PAGE
                c = np.searchsorted(starts, q, side="right") - 1
                ok = (q + PAGE <= ends[c]) & whole[c]
                page_src[k0 : k0 + len(q)][ok] = c[ok]
                page_off[k0 : k0 + len(q)][ok] = q[ok] - starts[c[ok]]
            src_ids, src_locs = list(ids), [locs[c] for c in ids]
            if not whole.all():
                _map_deltas(reader, repo, ids, locs, starts, np.flatnonzero(~whole), src_ids,
                            src_locs, page_src, page_off)
        except StoreError:
            return None  # a damaged parent: store this file without deltas
        anchors = {c: (int(s), int(e)) for c, s, e in zip(ids, starts, ends, strict=True)}
        for c, count in Counter(ids).items():
            if count > 1:
                del anchors[c]  # repeated chunks (zeros) say nothing about position
        return cls(src_ids, src_locs, page_src, page_off, anchors)

    def worth_trying(self) -> bool:
        """Whether to try a delta for the next new chunk (see TRIAL)."""
        if self.tried < TRIAL or self.hits * HIT_RATE >= self.tried:
            return True
        self.skipped += 1
        return self.skipped % SPARSE == 0

    def record(self, hit: bool) -> None:
        """Count one attempt."""
        self.tried += 1
        self.hits += hit

    def shifts(self, ids: list[bytes], starts: list[int], ends: list[int], i: int) -> list[int]:
        """Candidate shifts (new offset - parent offset) for the new chunk ``i`` of a job,
        from the nearest unchanged chunks before and after it, then 0."""
        out: list[int] = []
        anchors = self.anchors
        for j in range(i - 1, max(i - 1 - NEIGHBOURS, -1), -1):
            a = anchors.get(ids[j])
            if a is not None:
                out.append(ends[j] - a[1])
                break
        for j in range(i + 1, min(i + 1 + NEIGHBOURS, len(ids))):
            a = anchors.get(ids[j])
            if a is not None:
                if starts[j] - a[0] not in out:
                    out.append(starts[j] - a[0])
                break
        if 0 not in out:
            out.append(0)
        return out

    def encode(self, chunk: memoryview, start: int, shift: int,
               source: Callable[[int], bytes | None], cctx: zstandard.ZstdCompressor,
               min_saving: float) -> bytes | None:
        """The delta payload of ``chunk`` (at stream offset ``start``) against the parent
        pages at ``start - shift``, or None when more than half of it would be literal.

        ``source(i)`` returns the verified plaintext of ``src_ids[i]``, or None if it
        cannot be read (its pages then count as changed).
        """
        n = len(chunk)
        pos = start - shift
        npg = n // PAGE
        if pos < 0 or pos % PAGE or not npg:
            return None
        budget = int(n * delta.MAX_LITERAL_SHARE)
        k0 = pos // PAGE
        k1 = min(k0 + npg, len(self.page_src))
        src = np.full(npg, -1, dtype=np.int64)
        off = np.zeros(npg, dtype=np.int64)
        if k1 > k0:
            src[: k1 - k0] = self.page_src[k0:k1]
            off[: k1 - k0] = self.page_off[k0:k1]
        words = np.frombuffer(chunk, dtype=np.uint64, count=npg * (PAGE // 8))
        zero = ~words.reshape(npg, PAGE // 8).any(axis=1)
        tail = n - npg * PAGE
        if int(((src < 0) & ~zero).sum()) * PAGE + tail > budget:
            return None
        data = bytes(chunk)
        kinds: list[int] = []  # per page: source index, ZEROS or LITERAL
        literal_bytes = tail
        for i in range(npg):
            s = int(src[i])
            if zero[i]:
                kinds.append(delta.ZEROS)
                continue
            if s >= 0:
                plain = source(s)
                o = int(off[i])
                if plain is not None and plain[o : o + PAGE] == data[i * PAGE : (i + 1) * PAGE]:
                    kinds.append(s)
                    continue
            kinds.append(delta.LITERAL)
            literal_bytes += PAGE
            if literal_bytes > budget:
                return None
        return _payload(data, kinds, off, tail, self.src_ids, cctx, min_saving)


def _payload(data: bytes, kinds: list[int], off: np.ndarray, tail: int, src_ids: list[bytes],
             cctx: zstandard.ZstdCompressor, min_saving: float) -> bytes:
    """The delta payload of a chunk whose pages are ``kinds`` (source index into
    ``src_ids``, ZEROS or LITERAL), literals zstd-compressed where that pays."""
    slots: dict[int, int] = {}  # source index in the map -> index in the delta
    sources: list[bytes] = []
    runs: list[list[int]] = []  # [src, length, source offset]
    literals: list[bytes] = []
    for i, k in enumerate(kinds):
        if k == delta.LITERAL:
            literals.append(data[i * PAGE : (i + 1) * PAGE])
            src, o = delta.LITERAL, 0
        elif k == delta.ZEROS:
            src, o = delta.ZEROS, 0
        else:
            src = slots.get(k)
            if src is None:
                src = slots[k] = len(sources)
                sources.append(src_ids[k])
            o = int(off[i])
        last = runs[-1] if runs else None
        if last is not None and last[0] == src and (
                src in (delta.LITERAL, delta.ZEROS) or last[2] + last[1] == o):
            last[1] += PAGE
        else:
            runs.append([src, PAGE, o])
    if tail:
        literals.append(data[len(data) - tail :])
        if runs and runs[-1][0] == delta.LITERAL:
            runs[-1][1] += tail
        else:
            runs.append([delta.LITERAL, tail, 0])
    lit = b"".join(literals)
    packed = cctx.compress(lit) if lit else b""
    zstd = bool(lit) and len(packed) <= len(lit) * (1 - min_saving)
    return delta.encode(sources, [(r[0], r[1], r[2]) for r in runs],
                        packed if zstd else lit, zstd, len(lit))


def _map_deltas(reader: ObjectReader, repo: Repository, ids: list[bytes],
                locs: dict[bytes, Location], starts: np.ndarray, which: np.ndarray,
                src_ids: list[bytes], src_locs: list[Location], page_src: np.ndarray,
                page_off: np.ndarray) -> None:
    """Map the pages of the parent's delta chunks to their (whole) sources."""
    headers = {int(c): reader.delta_header(ids[c], locs[ids[c]]) for c in which}
    wanted = list({s for h in headers.values() for s in h.sources})
    found = repo.index.lookup_many(wanted)
    slot: dict[bytes, int] = {}
    for sid in wanted:
        loc = found.get(sid)
        if loc is not None and loc.compression != DELTA:
            slot[sid] = len(src_ids)
            src_ids.append(sid)
            src_locs.append(loc)
    npages = len(page_src)
    for c, h in headers.items():
        pos = int(starts[c])
        for s, length, o in h.runs:
            if s not in (delta.LITERAL, delta.ZEROS) and h.sources[s] in slot:
                k0 = -(-pos // PAGE)
                k1 = min((pos + length) // PAGE, npages)
                if k1 > k0:
                    ks = np.arange(k0, k1, dtype=np.int64)
                    page_src[k0:k1] = slot[h.sources[s]]
                    page_off[k0:k1] = o + ks * PAGE - pos
            pos += length
