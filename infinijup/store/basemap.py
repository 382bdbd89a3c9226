"""Finding page deltas: a new chunk against its parent file's pages at the same place.

A snapshot's ``pages-*.img`` is mostly its parent's: CDC finds the unchanged chunks by id,
and a chunk with a few changed pages is new. For such a chunk, the nearest unchanged chunk
before (or after) it in the same job says where it lies in the parent file: right after
(before) that chunk's place there; with no unchanged chunk near, the same offset in the
parent. ``BaseMap.encode`` compares each page of the new chunk
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

import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from . import delta, layouts
from .chunking import PAGE
from .errors import StoreError
from .index import Location
from .packs import DELTA

if TYPE_CHECKING:
    from .reader import ObjectReader
    from .repo_view import RepoView

NEIGHBOURS = 8  # chunks looked at on each side of a new chunk for an unchanged one
_ZERO_PAGE = bytes(PAGE)
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

    def __init__(self, repo: RepoView, reader: ObjectReader, ids: list[bytes],
                 ends: np.ndarray | None = None) -> None:
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
        # where each chunk ends: known from the blob's layout, else looked up when needed
        self._ends_cache: np.ndarray | bool | None = ends
        self._ends_lock = threading.Lock()
        self.tried = 0
        self.hits = 0
        self.skipped = 0

    @classmethod
    def build(cls, repo: RepoView, reader: ObjectReader, blob_id: str) -> BaseMap | None:
        """The map of the stored file ``blob_id``, or None if it cannot be read."""
        try:
            size, ids = repo.get_blob_chunks(blob_id)
        except StoreError:
            return None  # a damaged parent: store this file without deltas
        if not ids:
            return None
        return cls(repo, reader, ids, layouts.known_ends(repo, blob_id, len(ids), size))

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
        if not out:  # everything around changed: try the same offset in the parent
            ends_parent = self._ends()
            if ends_parent is not None:
                j = int(np.searchsorted(ends_parent, starts[i], side="right"))
                if j < len(self.ids):
                    out.append((j, starts[i] - (int(ends_parent[j - 1]) if j else 0)))
        return out

    def _ends(self) -> np.ndarray | None:
        """End offsets of the parent's chunks (one query for all of them, made only when a
        new chunk has no unchanged neighbour); None if some are not indexed."""
        with self._ends_lock:
            if self._ends_cache is None:
                found = self.repo.index.lookup_many(self.ids)
                if len(found) < len(set(self.ids)):
                    self._ends_cache = False
                else:
                    self._ends_cache = np.cumsum(
                        np.fromiter((found[c].raw_length for c in self.ids), np.int64,
                                    len(self.ids)))
            return self._ends_cache if self._ends_cache is not False else None

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
        targets = self._pages(*place, npg)
        data = bytes(chunk)
        runs = _Runs(data)
        for i in range(npg):
            page = data[i * PAGE : (i + 1) * PAGE]
            t = targets[i]
            if t is not None:
                plain = source(t[0], t[1])
                if plain is not None and plain[t[2] : t[2] + PAGE] == page:
                    runs.add(t[0], PAGE, t[2])
                    continue
            if page == _ZERO_PAGE:
                runs.add(delta.ZEROS, PAGE, 0)
                continue
            runs.add(delta.LITERAL, PAGE, i * PAGE)
            if runs.literal > budget:
                return None
        if n > npg * PAGE:
            runs.add(delta.LITERAL, n - npg * PAGE, npg * PAGE)
            if runs.literal > budget:
                return None
        return runs.payload(cctx, min_saving)

    # -- the parent's pages ----------------------------------------------------------------

    def _pages(self, j: int, pos: int, count: int) -> list[PagePlace | None]:
        """Where ``count`` pages of the parent are stored whole, from ``pos`` bytes after
        the start of parent chunk ``j`` on (None: unknown, or not a whole page of one
        chunk)."""
        ids = self.ids
        n = len(ids)
        out: list[PagePlace | None] = [None] * count
        try:
            while pos < 0:
                if j == 0:
                    return out
                j -= 1
                pos += self._length(j)
            length = self._length(j) if j < n else 0
            for i in range(count):
                while j < n and pos >= length:
                    pos -= length
                    j += 1
                    length = self._length(j) if j < n else 0
                if j >= n:
                    break
                if pos + PAGE <= length:
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
        """Raw length of parent chunk ``j`` (looked up once: one indexed query, ~20 us;
        a query for many ids costs more than the few a new chunk needs)."""
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


class _Runs:
    """The runs of a delta being built: consecutive pieces merge."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.runs: list[list] = []  # [LITERAL, ZEROS or a source id, length, offset]
        self.literals: list[bytes] = []
        self.literal = 0

    def add(self, kind: int | bytes, length: int, offset: int) -> None:
        """Append ``length`` bytes: of source ``kind`` from ``offset``, zeros, or literal
        bytes of the chunk from ``offset``."""
        if kind == delta.LITERAL:
            self.literals.append(self.data[offset : offset + length])
            self.literal += length
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] == kind and (
                not isinstance(kind, bytes) or last[2] + last[1] == offset):
            last[1] += length
        else:
            self.runs.append([kind, length, offset])

    def payload(self, cctx: zstandard.ZstdCompressor, min_saving: float) -> bytes:
        """The delta payload, literals zstd-compressed where that pays."""
        slots: dict[bytes, int] = {}
        runs: list[delta.Run] = []
        for kind, length, offset in self.runs:
            if isinstance(kind, bytes):
                runs.append((slots.setdefault(kind, len(slots)), length, offset))
            else:
                runs.append((kind, length, 0))
        lit = b"".join(self.literals)
        packed = cctx.compress(lit) if lit else b""
        zstd = bool(lit) and len(packed) <= len(lit) * (1 - min_saving)
        return delta.encode(list(slots), runs, packed if zstd else lit, zstd, len(lit))
