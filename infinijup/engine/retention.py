"""Which automatic snapshots to thin (issue 30): pure, the server's retention.py applies it.

Automatic snapshots are many (one after each cell worth it), so they are kept in a window:

* every one of the last ``keep_all_s`` (an hour);
* older ones, one per ``every_s`` (10 minutes): the newest of each slot;
* at most ``max_count`` of them in all, and their stored bytes at most ``max_bytes`` (0: no
  limit): past that, the oldest go first.

Thinning is done in batches, because each batch costs a gc of the whole store: a pass thins
nothing until the window is over one of its limits (or at least ``batch`` snapshots have aged
out of their slot), and then thins the window down to ``slack`` (10%) *below* its limits, so
the next passes have room. The limits are never exceeded after a pass: a window of
``max_count`` 100 holds 90 to 100 snapshots once full, one of ``max_bytes`` 64 MiB between
57.6 and 64 MiB; only the snapshot just stored is over them, until the pass that follows it.

Never thinned: a snapshot the user took (only ``metadata.auto`` ones are considered), and any
in ``protected`` (what a running kernel stands on, a hibernated kernel sleeps in, a thread ends
at, a redo would return to). Protected snapshots count in the window; when they alone fill it,
it is over its limits and nothing more can go. A thinned commit keeps its place in the history;
only its images go (store/thinned.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    keep_all_s: float = 3600.0
    every_s: float = 600.0
    max_count: int = 200
    max_bytes: int = 0
    slack: float = 0.1  # once over a limit, thin to this share below it (0: to the limit)

    @property
    def batch(self) -> int:
        """How many snapshots a pass thins at least (when it thins for age alone), and how
        far below ``max_count`` it thins: ``max(1, slack * max_count)``, less than the
        count itself (a window of one snapshot is thinned to one)."""
        if self.slack <= 0:
            return 1
        return max(1, min(int(self.max_count * self.slack), self.max_count - 1))

    def low_water(self) -> tuple[int, int]:
        """(count, bytes) a pass over the limits thins down to."""
        count = self.max_count - (self.batch if self.slack > 0 and self.max_count > 1 else 0)
        return count, self.max_bytes - int(self.max_bytes * max(0.0, self.slack))


@dataclass(frozen=True)
class Auto:
    """An automatic snapshot not thinned yet."""

    id: str
    created: float
    stored_bytes: int


def over_limits(autos: list[Auto], window: Window) -> bool:
    """Are ``autos`` (those not thinned) more than the window's count or bytes?"""
    return len(autos) > window.max_count or (
        window.max_bytes > 0 and sum(a.stored_bytes for a in autos) > window.max_bytes)


def to_thin(autos: list[Auto], now: float, window: Window, protected: set[str]) -> list[str]:
    """The ids of ``autos`` to thin, oldest first: none unless the window is over a limit or
    a batch has aged out."""
    kept: list[Auto] = []  # newest first
    aged: list[Auto] = []
    slots: set[int] = set()
    for a in sorted(autos, key=lambda a: a.created, reverse=True):
        if a.id in protected or now - a.created <= window.keep_all_s:
            kept.append(a)
            continue
        slot = int(a.created // window.every_s) if window.every_s > 0 else 0
        if slot in slots:
            aged.append(a)
        else:
            slots.add(slot)
            kept.append(a)
    over = over_limits(autos, window)
    if not over and len(aged) < window.batch:
        return []  # wait for a batch: the gc after a thinning reads the whole store
    thin = list(aged)
    if over:  # the oldest unprotected go first, down to the low-water mark
        count, size = len(kept), sum(a.stored_bytes for a in kept)
        low_count, low_bytes = window.low_water()
        for a in reversed(kept):
            if count <= low_count and (window.max_bytes <= 0 or size <= low_bytes):
                break
            if a.id in protected:
                continue
            thin.append(a)
            count -= 1
            size -= a.stored_bytes
    return [a.id for a in sorted(thin, key=lambda a: a.created)]
