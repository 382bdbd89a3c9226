"""Getting space back: deleting a snapshot or a thread, and what the store takes on disk.

A snapshot is a commit; a thread is a named ref to its newest commit (its tip). Commits are
content-addressed: a commit names its parents by id, so no commit can be taken out from under
another. The rules:

- **Delete a thread** (``plan_thread_delete``): its ref goes. The snapshots that only it reached
  go with it; those another thread also reaches (the history before a branch point) stay.
- **Delete a snapshot** (``plan_commit_delete``): only a snapshot that no other snapshot builds
  on (no child among the commits the threads reach). Each thread whose tip it is moves back to
  its parent; a thread whose tip is a first snapshot (no parent) has nothing left and goes. A
  snapshot with children is refused, naming them: they are stored as its descendants, and
  since snapshots share their unchanged chunks, deleting one from the middle of a thread would
  free little anyway. Delete from the tip, or delete the thread.
- Either is refused (``DeleteRefused``, 409) when it would remove a commit in ``needed``: the
  caller's map of commits something outside the store stands on (a running kernel's HEAD, the
  snapshot a hibernated kernel sleeps in) to the reason. ``threads``, when given, are the only
  threads the deletion may move or remove (the server gives a notebook's own): a snapshot that
  is the tip of another thread too is refused.

``delete`` executes a plan: each thread moves by compare-and-swap from the tip it had when
planned (a thread that moved meanwhile: RefConflict, 409, and nothing after it changes), then
``gc`` removes what no thread reaches, keeping ``needed`` (so the space is reclaimed now, not at
the next gc). A commit pushed to a remote stays there: this deletes the local copy only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infinijup.errors import Conflict

from .errors import InvalidRef, StoreError, UnknownRef
from .gc import GcReport, gc
from .hot_dir import usage
from .objects import Commit

if TYPE_CHECKING:
    from .repository import Repository

_HEX = frozenset("0123456789abcdef")


class DeleteRefused(StoreError, Conflict):
    """A snapshot or thread cannot be deleted; the message says what still needs it."""

    reason = "delete_refused"


@dataclass(frozen=True)
class Deletion:
    """A planned deletion: which threads move where, and which commits then go."""

    commit: str | None  # the snapshot deleted (None: a thread)
    thread: str | None  # the thread deleted (None: a snapshot)
    moves: dict[str, str | None]  # thread -> its new tip (None: the thread is removed)
    tips: dict[str, str]  # thread -> its tip when planned (compare-and-swap)
    removed: tuple[str, ...]  # commits no thread reaches afterwards (gc removes them)


@dataclass(frozen=True)
class DeleteReport:
    deletion: Deletion
    gc: GcReport | None = None
    store_bytes_before: int = 0
    store_bytes_after: int = 0
    notes: list[str] = field(default_factory=list)


def plan_commit_delete(repo: Repository, ref: str, *, needed: Mapping[str, str] | None = None,
                       threads: Collection[str] | None = None) -> Deletion:
    """Plan deleting the snapshot ``ref`` (a commit id or a unique prefix of 8+ hex digits)."""
    needed = needed or {}
    cid = _commit_id(repo, ref)
    commit = repo.get_commit(cid)
    tips = repo.threads()
    reached = _reachable(repo, tips.values())
    children = sorted((c for c in reached.values() if cid in c.parents),
                      key=lambda c: c.created)
    if children:
        names = ", ".join(c.id[:12] for c in children[:5]) + \
            (f" and {len(children) - 5} more" if len(children) > 5 else "")
        raise DeleteRefused(
            f"snapshot {cid[:12]} cannot be deleted: {len(children)} later snapshot"
            f"{'s' if len(children) > 1 else ''} build on it ({names}). Delete those first "
            "(from the newest), or delete the whole thread", reason="snapshot_has_children")
    ending = sorted(name for name, tip in tips.items() if tip == cid)
    foreign = [name for name in ending if threads is not None and name not in threads]
    if foreign:
        raise DeleteRefused(f"snapshot {cid[:12]} cannot be deleted: another thread ends at "
                            f"it ({', '.join(foreign)})", reason="snapshot_shared")
    parent = commit.parents[0] if commit.parents else None
    moves: dict[str, str | None] = {name: parent for name in ending}
    after = {**{n: t for n, t in tips.items() if n not in moves},
             **{n: t for n, t in moves.items() if t is not None}}
    removed = set(reached) - set(_reachable(repo, after.values())) | {cid}
    _refuse_needed(removed, needed, f"snapshot {cid[:12]}")
    return Deletion(cid, None, moves, {n: cid for n in ending}, tuple(sorted(removed)))


def plan_thread_delete(repo: Repository, name: str, *,
                       needed: Mapping[str, str] | None = None) -> Deletion:
    """Plan deleting thread ``name`` (a store thread name)."""
    needed = needed or {}
    tips = repo.threads()
    if name not in tips:
        raise UnknownRef(f"no thread {name!r}")
    others = [t for n, t in tips.items() if n != name]
    removed = set(_reachable(repo, [tips[name]])) - set(_reachable(repo, others))
    _refuse_needed(removed, needed, f"thread {name!r}")
    return Deletion(None, name, {name: None}, {name: tips[name]}, tuple(sorted(removed)))


def delete(repo: Repository, deletion: Deletion, *, needed: Iterable[str] = (),
           collect: bool = True) -> DeleteReport:
    """Move or remove the planned threads (compare-and-swap), then, with ``collect``, gc
    (keeping ``needed``) so that the space comes back now."""
    before = store_bytes(repo)
    for name, new_tip in deletion.moves.items():
        if new_tip is None:
            repo.delete_thread(name, expected=deletion.tips[name])
        else:
            repo.set_thread(name, new_tip, expected=deletion.tips[name])
    report = gc(repo, keep=needed) if collect else None
    return DeleteReport(deletion, report, before, store_bytes(repo))


def store_bytes(repo: Repository) -> int:
    """Bytes the store takes on disk (allocated: packs, commits, index, refs)."""
    return usage(Path(repo.path))


def format_bytes(n: int) -> str:
    """Decimal units, as the panel shows them (gpu/room_plan.py's ``fmt``): 2.7 GB, 45 MB;
    and, smaller, 1.6 MB, 5 kB, 12 B."""
    if n >= 10**8:
        return f"{n / 1e9:.1f} GB"
    if n >= 10**7:
        return f"{n / 1e6:.0f} MB"
    if n >= 10**6:
        return f"{n / 1e6:.1f} MB"
    if n >= 10**3:
        return f"{n / 1e3:.0f} kB"
    return f"{int(n)} B"


def _commit_id(repo: Repository, ref: str) -> str:
    if not isinstance(ref, str) or not ref or not set(ref.lower()) <= _HEX:
        raise InvalidRef(f"{ref!r} is not a snapshot id: give its id (or a unique prefix of "
                         "8+ hex digits); to delete a thread, delete the thread")
    return repo.resolve(ref.lower())


def _reachable(repo: Repository, tips: Iterable[str]) -> dict[str, Commit]:
    seen: dict[str, Commit] = {}
    stack = list(tips)
    while stack:
        cid = stack.pop()
        if cid in seen:
            continue
        seen[cid] = c = repo.get_commit(cid)
        stack.extend(p for p in c.parents if p not in seen)
    return seen


def _refuse_needed(removed: set[str], needed: Mapping[str, str], what: str) -> None:
    held = sorted(c for c in removed if c in needed)
    if held:
        why = "; ".join(f"{c[:12]} is {needed[c]}" for c in held)
        raise DeleteRefused(f"{what} cannot be deleted: {why}", reason="snapshot_in_use")


__all__ = ["DeleteRefused", "DeleteReport", "Deletion", "delete", "format_bytes",
           "plan_commit_delete", "plan_thread_delete", "store_bytes"]
