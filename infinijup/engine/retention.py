"""Which automatic snapshots to thin (issue 30): pure, the server's retention.py applies it.

Automatic snapshots are many (one after each cell worth it), so they are kept in a window:

* every one of the last ``keep_all_s`` (an hour);
* older ones, one per ``every_s`` (10 minutes): the newest of each slot;
* at most ``max_count`` of them in all, and their stored bytes at most ``max_bytes`` (0: no
  limit): past that, the oldest go first.

Never thinned: a snapshot the user took (only ``metadata.auto`` ones are considered), and any
in ``protected`` (what a running kernel stands on, a hibernated kernel sleeps in, a thread ends
at, a redo would return to). A thinned commit keeps its place in the history; only its images
go (store/thinned.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    keep_all_s: float = 3600.0
    every_s: float = 600.0
    max_count: int = 200
    max_bytes: int = 0


@dataclass(frozen=True)
class Auto:
    """An automatic snapshot not thinned yet."""

    id: str
    created: float
    stored_bytes: int


def to_thin(autos: list[Auto], now: float, window: Window, protected: set[str]) -> list[str]:
    """The ids of ``autos`` to thin, oldest first."""
    kept: list[Auto] = []  # newest first
    thin: list[Auto] = []
    slots: set[int] = set()
    for a in sorted(autos, key=lambda a: a.created, reverse=True):
        if a.id in protected or now - a.created <= window.keep_all_s:
            kept.append(a)
            continue
        slot = int(a.created // window.every_s) if window.every_s > 0 else 0
        if slot in slots:
            thin.append(a)
        else:
            slots.add(slot)
            kept.append(a)
    # the limits: the oldest unprotected go first
    removable = [a for a in reversed(kept) if a.id not in protected]
    count = len(kept)
    size = sum(a.stored_bytes for a in kept)
    for a in removable:
        over_count = count > window.max_count
        over_bytes = window.max_bytes > 0 and size > window.max_bytes
        if not (over_count or over_bytes):
            break
        thin.append(a)
        count -= 1
        size -= a.stored_bytes
    return [a.id for a in sorted(thin, key=lambda a: a.created)]
