"""Storing a new version of a large file that changed in known places, reading only those.

A GPU kernel's segments file is tens of GB, and a snapshot after a small change rewrites a few
hundred MB of it in place (the arena copies only the blocks whose hash changed: gpu/block_hash.py);
the kernel says which ranges may differ from the version stored last. Reading the whole file
again to find that out took 22-28 s for 30 GB on an H200 host.

The blob stored is the one a whole ingest would give, chunk for chunk. Content-defined chunking
decides a chunk end from the bytes since the previous end only (and, for ``fastcdc``, the 32
before the candidate, never before the previous end plus ``min_size``). So, for a change at
``[a, b)``:

* every chunk of the stored version that ends at or before ``a`` is the new file's too (its
  bytes, and those before it, did not change);
* from the last such end ``X``, the new bytes are cut afresh, a stream of their own starting at
  ``X`` (the splitter starts there, as after any end), up to a cut ``Y`` of the stored version
  ``MARGIN`` past ``b`` (or the end of the file);
* at the first fresh cut ``c >= b`` that is also a cut of the stored version (not its last one,
  which the end of its file forced), the two agree again: from ``c`` on, the bytes and the
  splitter's state are the same, so are the cuts. Where none comes before ``Y`` (a change
  followed by a long run of zeros, where both are cut every ``max_size`` from where the run
  began), the window's last chunk ends at ``Y`` and the stored chunks follow: the bytes are
  the file's, but the chunks around ``Y`` are not those a whole ingest would cut (later
  versions stored from this one are still right: only "the bytes after a cut did not
  change" is relied on for that).

Changes closer together than a window are taken in one. The stored version's chunk ends come
from its layout (layouts.py) or, without one, from the index; without either, or where most of
the file changed, the caller reads it all.
"""

from __future__ import annotations

import os
from array import array
from typing import TYPE_CHECKING

import numpy as np

from . import layouts
from .errors import StoreError
from .objects import Blob
from .writer import Writer, _StreamIngest

if TYPE_CHECKING:
    from collections.abc import Iterable

MARGIN = 256 << 10  # bytes read past a change at first (2 of the largest chunks), to meet
# the stored version's cuts; four times as far each time they do not
MOST = 0.5  # past this share of the file to read, the whole file is read instead


class _Slice:
    """Bytes ``[start, end)`` of the file open at ``fd``, as a stream (``readinto``)."""

    def __init__(self, fd: int, start: int, end: int) -> None:
        self.fd, self.at, self.end = fd, start, end

    def readinto(self, view: memoryview) -> int:
        want = min(len(view), self.end - self.at)
        if want <= 0:
            return 0
        n = os.preadv(self.fd, [view[:want]], self.at)
        self.at += n
        return n


def merged(changed: Iterable[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The (offset, length) ranges as sorted, disjoint [start, end) pairs inside the file."""
    spans = sorted((max(0, int(o)), min(size, int(o) + int(n))) for o, n in changed if n > 0)
    out: list[list[int]] = []
    for a, b in spans:
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def stored_ends(writer: Writer, base: Blob) -> tuple[list[bytes], np.ndarray] | None:
    """The stored version's chunk ids and where each ends, or None where unknown."""
    repo = writer.repo
    try:
        size, ids = repo.get_blob_chunks(base.id)
    except StoreError:
        return None
    if not ids or size != base.size:
        return None
    known = layouts.known_ends(repo, base.id, len(ids), size)
    if known is not None:
        return ids, known
    found = repo.index.lookup_many(ids)
    if any(c not in found for c in ids):
        return None
    ends = np.cumsum(np.fromiter((found[c].raw_length for c in ids), np.int64, len(ids)))
    return (ids, ends) if int(ends[-1]) == size else None


def add_changed_file(writer: Writer, fd: int, *, base: Blob,
                     changed: Iterable[tuple[int, int]]) -> Blob:
    """Store the file open at ``fd`` with ``writer``, known to differ from the stored ``base``
    only in the ``changed`` (offset, length) ranges (its size may differ too): only those are
    read, and around them (see module docs). Reads it all where ``base``'s chunk ends are not
    known or most of it changed."""
    got = ingest_changed(writer, fd, base, changed)
    if got is None:
        with open(f"/proc/self/fd/{fd}", "rb", buffering=0) as f:
            return writer.add_stream(f, base=base)
    return writer._blob(*got)


def ingest_changed(writer: Writer, fd: int, base: Blob, changed: Iterable[tuple[int, int]]
                   ) -> tuple[list[bytes], array, int] | None:
    """(chunk ids, their ends, size) of the file at ``fd``, which differs from ``base`` only
    in ``changed``; None: read it all instead (see module docs)."""
    size = os.fstat(fd).st_size
    if size == 0 or base.size == 0:
        return None
    spans = merged(changed, size)
    if size != base.size:  # the end moved: the chunks about the old end are cut anew
        spans = merged([(a, b - a) for a, b in spans] +
                       [(min(size, base.size) - 1, max(size, base.size))], size)
    if sum(b - a for a, b in spans) > MOST * size:
        return None
    known = stored_ends(writer, base)
    if known is None:
        return None
    base_ids, base_ends = known
    natural = base_ends[:-1]  # the stored version's last end is where its file ended
    # where a window may end: any cut of the stored version short of the file's (new) end
    cuts = base_ends if size == base.size else base_ends[base_ends < size]
    bmap = writer._base_map(base, known)
    ids: list[bytes] = []
    ends = array("q")
    pos, k = 0, 0  # pos: an end of the stored version, all before it done

    def take_stored(upto: int) -> None:
        i = int(np.searchsorted(base_ends, pos, side="right"))
        j = int(np.searchsorted(base_ends, upto, side="right"))
        ids.extend(base_ids[i:j])
        ends.extend(base_ends[i:j].tolist())

    while k < len(spans):
        a, b = spans[k]
        i = int(np.searchsorted(natural, a, side="right"))
        start = max(pos, int(natural[i - 1]) if i else 0)
        take_stored(start)
        pos = start
        # the window: to a cut of the stored version MARGIN past the last change it takes in
        last = k
        while True:
            j = int(np.searchsorted(cuts, b + MARGIN, side="left"))
            stop = min(int(cuts[j]) if j < len(cuts) else size, size)
            if last + 1 < len(spans) and spans[last + 1][0] < stop:
                last += 1
                b = max(b, spans[last][1])
                continue
            break
        window = _StreamIngest(writer, _Slice(fd, start, stop), bmap, origin=start)
        w_ids, _ = window.run()
        found = _meeting(window.ends, spans[k:last + 1], natural)
        ids.extend(w_ids[:found + 1])
        ends.extend(window.ends[:found + 1])
        pos, k = int(window.ends[found]), last + 1
    if pos < size:
        if size != base.size:
            raise AssertionError("a change at the end was not cut anew")
        take_stored(size)
    if int(ends[-1]) != size or len(ends) != len(ids):
        raise AssertionError(f"incremental ingest lost bytes: {ends[-1]} != {size}")
    return ids, ends, size


def _meeting(w_ends: array, spans: list[tuple[int, int]], natural: np.ndarray) -> int:
    """Which of a window's cuts to keep up to: the first past its changes that is a natural
    cut of the stored version (from there on the two are cut alike), else its last one (at
    the end of the file, or forced at a cut of the stored version: the blob then differs from
    a whole ingest's around that cut, its bytes do not)."""
    need = max(b for _, b in spans)
    for idx, c in enumerate(w_ends):
        if c >= need:
            j = int(np.searchsorted(natural, c))
            if j < len(natural) and int(natural[j]) == c:
                return idx
    return len(w_ends) - 1
