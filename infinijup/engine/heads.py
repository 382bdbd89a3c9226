"""Thread rules: where a kernel's next snapshot goes.

- Snapshots go on the kernel's current thread (``main`` by default).
- After a restore of a commit that is not its thread's tip, the next snapshot starts a new
  thread, auto-named (``main-1``...) unless the user named one.
- A fresh kernel (just started or restarted: its state comes from no snapshot) starts a new
  root: its next snapshot has no parent, on its thread if that has no snapshot yet, else on a
  new thread next to it. Recording it as a child of the thread's tip would claim it descends
  from a state it never had (its "deleted" variables were never deleted).
- A thread moves only by compare-and-swap from the tip we last saw: if someone else moved it
  meanwhile, the snapshot goes on a new thread instead. No operation ever drops a commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from .naming import DEFAULT_THREAD, auto_thread_name, check_thread_name


@dataclass(frozen=True)
class Head:
    """Where a kernel is: the commit its state came from (None: fresh) and its thread.

    ``thread`` None means "a new thread next to ``base_thread`` on the next snapshot".
    """

    commit: str | None
    thread: str | None
    base_thread: str = DEFAULT_THREAD


@dataclass(frozen=True)
class SnapshotPlan:
    thread: str
    parents: tuple[str, ...]
    expected_tip: str | None  # the thread's tip we require (None: the thread must not exist)


def plan_snapshot(head: Head, threads: dict[str, str], requested: str | None) -> SnapshotPlan:
    """Decide thread and parents of the next snapshot of a kernel at ``head``.

    ``threads`` is the notebook's thread table (name -> tip), ``requested`` a thread the user
    asked for explicitly.
    """
    parents = (head.commit,) if head.commit else ()
    if requested is not None:
        name = check_thread_name(requested)
        tip = threads.get(name)
        if tip is None or tip == head.commit:
            return SnapshotPlan(name, parents, tip)
        # The named thread has moved elsewhere (or this is a fresh kernel's new root): never
        # rewrite it, branch next to it.
        return SnapshotPlan(auto_thread_name(name, set(threads)), parents, None)
    name = head.thread
    if name is not None:
        tip = threads.get(name)
        if tip == head.commit or tip is None:
            return SnapshotPlan(name, parents, tip)
        base = name
    else:
        base = head.base_thread
    return SnapshotPlan(auto_thread_name(base, set(threads)), parents, None)


def head_after_restore(commit: str, commit_thread: str, threads: dict[str, str],
                       branch: str | None) -> Head:
    """Where a kernel is after restoring ``commit`` (committed on ``commit_thread``)."""
    if branch is not None:
        return Head(commit=commit, thread=check_thread_name(branch), base_thread=branch)
    for name, tip in sorted(threads.items(), key=lambda kv: kv[0] != commit_thread):
        if tip == commit:
            return Head(commit=commit, thread=name, base_thread=name)
    return Head(commit=commit, thread=None, base_thread=commit_thread)


def unchanged_since(parent_meta: dict, execution_count: int | None, described: dict,
                    cells_count: bool = True) -> bool:
    """Is a kernel about to be snapshotted (``execution_count`` and ``described``: its
    quiesce answer) still in the state of the snapshot it stands on (``parent_meta``)?

    Only when nothing says otherwise: no cell ran since (the same execution count), no variable
    changed (the kernel compares each fingerprint with that snapshot's), and the same names are
    there. A list truncated on either side, or a count missing, answers False. What this cannot
    see is a change made by a thread of the kernel's own to something no fingerprint covers;
    that change is still in the snapshot taken (a hibernation wakes from it), only not shown
    as a commit of its own.

    ``cells_count`` False (an undo's question): cells that changed no variable (a print, a
    plot) do not count as a change.
    """
    count = parent_meta.get("execution_count")
    if cells_count and (execution_count is None or count is None or count != execution_count):
        return False
    now, then = described.get("variables"), parent_meta.get("variables")
    if not isinstance(now, dict) or not isinstance(then, dict):
        return False
    if now.get("truncated") or then.get("truncated"):
        return False
    items, before = now.get("items") or [], then.get("items") or []
    if any(it.get("changed") for it in items):
        return False
    return {it.get("name") for it in items} == {it.get("name") for it in before}
