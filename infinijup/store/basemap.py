"""Finding page deltas: a new chunk against its parent file's pages at the same place.

A snapshot's ``pages-*.img`` is mostly its parent's: CDC finds the unchanged chunks by id,
and a chunk with a few changed pages is new. For such a chunk, the nearest unchanged chunk
before (or after) it in the same job says where it lies in the parent file: right after
(before) that chunk's place there. ``BaseMap.encode`` compares each page of the new chunk
with the parent's page at that place and, if at most half of the chunk is new bytes,
returns its delta payload (delta.py): the matching pages as runs of parent chunks, the rest
as literals.

Sources are always chunks stored whole: a parent page inside a chunk that is itself a delta
is taken from that delta's source (its literal pages are not used), so deltas never nest.
Nothing is computed for the whole parent file up front: the map holds the parent's chunk
ids, and the lengths and headers of the few parent chunks next to each new chunk are looked
up when needed (and cached). Only ingest with a parent pays for any of this, and only for
new chunks.
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

NEIGHBOURS = 8  # chunks looked at on each side of a new chunk for an unchanged one
# When the file has little in common with its parent, trying costs reads for nothing: after
# TRIAL attempts, if fewer than 1 in HIT_RATE succeed, only every SPARSE-th chunk is tried.
TRIAL, HIT_RATE, SPARSE = 64, 8, 16

#: Where a parent page is stored whole: (source chunk id, its location, offset in it).
PagePlace = tuple[bytes, Location, int]


class BaseMap:
    """A parent file's chunks, to find where its pages are (see module docs).

    Used from the writer's worker threads: the caches are plain dicts (a race at worst
    looks a chunk up twice) and the counters are approximate.
    """

    def __init__(self, repo: Repository, reader: ObjectReader, ids: list[bytes]) -> None:
        self.repo = repo
        self.reader = reader
        self.ids = ids
        anchors = {c: j for j, c in enumerate(ids)}
        for c, count in Counter(ids).items():
            if count > 1:
                del anchors[c]  # repeated chunks (zeros) say nothing about position
        self.anchors = anchors
        self._locs: dict[bytes, Location | None] = {}
        self._headers: dict[bytes, delta.Delta | None] = {}
        self.tried = 0
        self.hits = 0
        self.skipped = 0

    @classmethod
    def build(cls, repo: Repository, reader: ObjectReader, blob_id: str) -> BaseMap | None:
        """The map of the stored file ``blob_id``, or None if it cannot be read."""
        try:
            _size, ids = repo.get_blob_chunks(blob_id)
        except StoreError:
            return None  # a damaged parent: store this file without deltas
        return cls(repo, reader, ids) if ids else None

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

    def places(self, ids: list[bytes], starts: list[int], ends: list[int], i: int
               ) -> list[tuple[int, int]]:
        """Where the new chunk ``i`` of a job may lie in the parent, as (parent chunk index,
        byte offset from its start, possibly negative): after the nearest unchanged chunk
        before it, and before the nearest one after it."""
        out: list[tuple[int, int]] = []
        anchors = self.anchors
        for j in range(i - 1, max(i - 1 - NEIGHBOURS, -1), -1):
            a = anchors.get(ids[j])
            if a is not None:
                out.append((a + 1, starts[i] - ends[j]))
                break
        for j in range(i + 1, min(i + 1 + NEIGHBOURS, len(ids))):
            a = anchors.get(ids[j])
            if a is not None:
                out.append((a, starts[i] - starts[j]))
                break
        return out

    def encode(self, chunk: memoryview, place: tuple[int, int],
               source: Callable[[bytes, Location], bytes | None],
               cctx: zstandard.ZstdCompressor, min_saving: float) -> bytes | None:
        """The delta payload of ``chunk`` against the parent pages at ``place`` (see
        ``places``), or None when more than half of it would be literal bytes.

        ``source(id, location)`` returns a source's verified plaintext, or None if it
        cannot be read (its pages then count as changed).
        """
        n = len(chunk)
        npg = n // PAGE
        if not npg:
            return None
        budget = int(n * delta.MAX_LITERAL_SHARE)
        tail = n - npg * PAGE
        words = np.frombuffer(chunk, dtype=np.uint64, count=npg * (PAGE // 8))
        zero = (~words.reshape(npg, PAGE // 8).any(axis=1)).tolist()
        targets = self._pages(*place, npg)
        if sum(1 for z, t in zip(zero, targets, strict=True) if not z and t is None) * PAGE \
                + tail > budget:
            return None
        data = bytes(chunk)
        kinds: list[tuple[int | bytes, int]] = []  # per page: (LITERAL/ZEROS/source id, offset)
        literal = tail
        for i in range(npg):
            if zero[i]:
                kinds.append((delta.ZEROS, 0))
                continue
            t = targets[i]
            if t is not None:
                plain = source(t[0], t[1])
                o = t[2]
                if plain is not None and plain[o : o + PAGE] == data[i * PAGE : (i + 1) * PAGE]:
                    kinds.append((t[0], o))
                    continue
            kinds.append((delta.LITERAL, 0))
            literal += PAGE
            if literal > budget:
                return None
        return _payload(data, kinds, tail, cctx, min_saving)

    # -- the parent's pages ----------------------------------------------------------------

    def _pages(self, j: int, pos: int, count: int) -> list[PagePlace | None]:
        """Where ``count`` pages of the parent are stored whole, from ``pos`` bytes after
        the start of parent chunk ``j`` on (None: unknown, or not a whole page of one
        chunk)."""
        ids = self.ids
        n = len(ids)
        out: list[PagePlace | None] = [None] * count
        try:
            while pos < 0 and j > 0:
                j -= 1
                pos += self._length(j)
            if pos < 0:
                return out
            for i in range(count):
                while j < n and pos >= self._length(j):
                    pos -= self._length(j)
                    j += 1
                if j >= n:
                    break
                if pos + PAGE <= self._length(j):
                    out[i] = self._place(ids[j], pos)
                pos += PAGE
        except StoreError:
            pass  # a parent chunk that cannot be looked up: its pages count as changed
        return out

    def _loc(self, cid: bytes) -> Location | None:
        if cid not in self._locs:
            self._locs[cid] = self.repo.index.lookup(cid)
        return self._locs[cid]

    def _length(self, j: int) -> int:
        loc = self._loc(self.ids[j])
        if loc is None:
            raise StoreError(f"parent chunk {self.ids[j].hex()} is not indexed")
        return loc.raw_length

    def _place(self, cid: bytes, pos: int) -> PagePlace | None:
        """Where the page ``pos`` bytes into parent chunk ``cid`` is stored whole."""
        loc = self._loc(cid)
        if loc is None:
            return None
        if loc.compression != DELTA:
            return cid, loc, pos
        h = self._headers.get(cid)
        if h is None:
            h = self._headers[cid] = self.reader.delta_header(cid, loc)
        at = 0
        for s, length, o in h.runs:
            if at <= pos and pos + PAGE <= at + length:
                if s in (delta.LITERAL, delta.ZEROS):
                    return None
                sid = h.sources[s]
                sloc = self._loc(sid)
                if sloc is None or sloc.compression == DELTA:
                    return None  # sources stay whole: never build on a delta
                return sid, sloc, o + pos - at
            at += length
            if at > pos:
                return None  # the page straddles two runs
        return None


def _payload(data: bytes, kinds: list[tuple[int | bytes, int]], tail: int,
             cctx: zstandard.ZstdCompressor, min_saving: float) -> bytes:
    """The delta payload of a chunk whose pages are ``kinds`` (LITERAL, ZEROS or a
    source id, with the offset in the source), literals zstd-compressed where that pays."""
    slots: dict[bytes, int] = {}
    runs: list[list[int]] = []  # [src, length, source offset]
    literals: list[bytes] = []
    for i, (k, o) in enumerate(kinds):
        if isinstance(k, bytes):
            src = slots.setdefault(k, len(slots))
        else:
            src = k
            if k == delta.LITERAL:
                literals.append(data[i * PAGE : (i + 1) * PAGE])
        last = runs[-1] if runs else None
        if last is not None and last[0] == src and (
                not isinstance(k, bytes) or last[2] + last[1] == o):
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
    return delta.encode(list(slots), [(r[0], r[1], r[2]) for r in runs],
                        packed if zstd else lit, zstd, len(lit))
