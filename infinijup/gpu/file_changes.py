"""Which bytes of the arena file a snapshot may have changed since the last one (issue 33).

The store then reads only those (store/incremental.py) instead of the whole file, which is
tens of GB for a model and changes by a few hundred MB after a small cell. What stays the
same between two snapshots into the same file:

* a block whose (address, length, offset in the file) and hash are those of the last
  snapshot (gpu/block_hash.py): its bytes in the file are the last snapshot's (copied then,
  or kept from before by the same rule), it is live now, so neither copied over nor punched;
* a hole then and now: zeros both times.

Everything else counts as changed: copied blocks, bytes punched out now, dead bytes, bytes
past the file's old end. It is more than the truth (a dead range not punched keeps its
bytes; a copied block may hold what it held), never less.
"""

from __future__ import annotations

import os

Span = tuple[int, int]  # [start, end)


def holes(fd: int) -> list[Span]:
    """The file's holes, as [start, end) spans (SEEK_DATA / SEEK_HOLE)."""
    size = os.fstat(fd).st_size
    out: list[Span] = []
    at = 0
    while at < size:
        try:
            data = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: a hole to the end
            out.append((at, size))
            break
        if data > at:
            out.append((at, data))
        at = os.lseek(fd, data, os.SEEK_HOLE)
    return out


def kept_blocks(now: dict, before: dict) -> list[Span]:
    """The file spans of the blocks whose hash is the last snapshot's (keys are (address,
    length, offset in the file))."""
    return [(key[2], key[2] + key[1]) for key, h in now.items() if before.get(key) == h]


def _union(spans: list[Span]) -> list[Span]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersection(xs: list[Span], ys: list[Span]) -> list[Span]:
    xs, ys = _union(xs), _union(ys)
    out: list[Span] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def changed(size: int, kept: list[Span], holes_before: list[Span],
            holes_now: list[Span]) -> list[tuple[int, int]]:
    """(offset, length) of every byte of the file (``size`` bytes now) that is neither in a
    kept block nor a hole both times."""
    same = _union(kept + _intersection(holes_before, holes_now))
    out: list[tuple[int, int]] = []
    at = 0
    for a, b in same:
        a, b = min(a, size), min(b, size)
        if a > at:
            out.append((at, a - at))
        at = max(at, b)
    if at < size:
        out.append((at, size - at))
    return out
