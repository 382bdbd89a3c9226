"""Getting space back from the panel (issue 28, item 8): delete a notebook's snapshot or thread,
and the sizes of the store and of the hot tier.

The rules are the store's (store/space.py): a snapshot no other snapshot builds on can go (each
of the notebook's threads ending at it moves back to its parent; a thread with nothing left
goes), a thread goes with the snapshots only it reaches. The server adds what only it knows,
the commits its kernels stand on, and refuses (409) a deletion that would take one:

- each running kernel's HEAD (``history.Heads``): its next snapshot names it as its parent;
- the snapshot each hibernated kernel sleeps in (``Hibernation.rests``, and the records beside
  the store, which outlive the server): its wake restores it.

A deletion is refused too while one of this server's kernels is being restored or woken (the
commit it restores is known only to that restore). gc then runs, keeping those commits, so the
space really comes back; then the hot tier drops its copies of snapshots no longer in the store
and of those no kernel has restored or kept for ``HOT_IDLE_S`` (their kernels are long gone),
never the copy of a commit a kernel stands on.
"""

from __future__ import annotations

import asyncio
import time

from ..engine.lifecycle import RESTORING, WAKING
from ..engine.naming import check_thread_name, notebook_key, notebook_threads, store_thread
from ..errors import BadRequest, Conflict, InfinijupError, NotFound
from ..store.hot_dir import Entry
from ..store.space import (
    delete,
    format_bytes,
    plan_commit_delete,
    plan_thread_delete,
    store_bytes,
)

HOT_IDLE_S = 7 * 86400


def needed(m) -> dict[str, str]:  # noqa: ANN001 - the SnapshotManager
    """Commit -> what stands on it: hibernated kernels' snapshots, running kernels' HEADs."""
    out: dict[str, str] = {}
    for record in m.hibernation._records():
        out[record["commit"]] = (f"the snapshot kernel {str(record.get('kernel_id'))[:8]} "
                                 f"({record.get('path')}) is hibernated in: wake it first")
    for kernel_id, rest in list(m.hibernation.rests.items()):
        if rest.commit:
            out.setdefault(rest.commit, f"the snapshot kernel {kernel_id[:8]} is hibernated "
                                        "in: wake it first")
    for kernel_id in m.kernel_ids():
        head = m.heads.get(kernel_id)
        if head.commit:
            out.setdefault(head.commit, f"the HEAD of running kernel {kernel_id[:8]}: its "
                                        "next snapshot builds on it (restore another first)")
    return out


async def delete_snapshot_or_thread(m, *, kernel_id: str | None, path: str | None,  # noqa: ANN001
                                    commit: str | None, thread: str | None) -> dict:
    """Delete ``commit`` or ``thread`` of the notebook (``kernel_id``'s or ``path``)."""
    if (commit is None) == (thread is None):
        raise BadRequest("give 'commit' or 'thread' (one of them)")
    if kernel_id is not None:
        m.kernel(kernel_id)
        path = await m.notebook_path(kernel_id)
    if not path:
        raise BadRequest("give kernel_id or path")
    if thread is not None:
        check_thread_name(thread)
    for kid in m.kernel_ids():
        if m.lifecycle.state(kid) in (RESTORING, WAKING):
            raise Conflict(f"kernel {kid[:8]} is being restored: delete once it is done",
                           reason="restore_under_way")
    keep = needed(m)
    key = notebook_key(path)

    def run() -> dict:
        repo = m.repo()
        own = notebook_threads(repo.threads(), key)
        if thread is not None:
            if thread not in own:
                raise NotFound(f"no thread '{thread}' in the history of {path}",
                               reason="unknown_thread")
            plan = plan_thread_delete(repo, store_thread(key, thread), needed=keep)
        else:
            plan = plan_commit_delete(repo, commit, needed=keep,
                                      threads={store_thread(key, n) for n in own})
            mine = {c.id for name in own for c in repo.log(store_thread(key, name))}
            if plan.commit not in mine:
                raise NotFound(f"no snapshot {commit} in the history of {path}",
                               reason="unknown_commit")
        report = delete(repo, plan, needed=keep)
        dropped = prune_hot(m, keep)
        prefix = store_thread(key, "")
        return {
            "path": path,
            "commit": plan.commit,
            "thread": thread,
            "threads": {name[len(prefix):]: tip for name, tip in plan.moves.items()},
            "removed": list(plan.removed),
            "store_bytes": report.store_bytes_after,
            "freed_bytes": max(0, report.store_bytes_before - report.store_bytes_after),
            "hot_dropped": len(dropped),
            "hot_freed_bytes": sum(e.bytes for e in dropped),
        }

    return await asyncio.to_thread(run)


def prune_hot(m, keep: dict[str, str] | set[str],  # noqa: ANN001
              drop: set[str] = frozenset()) -> list[Entry]:
    """Drop the hot copies of snapshots gone from the store (or thinned: ``drop``), and of
    those unused for ``HOT_IDLE_S``, except what a kernel stands on (from a worker thread;
    never raises)."""
    repo = m.repo()
    now = time.time()

    store_id = repo.config.id

    def wanted(e: Entry) -> bool:
        if e.commit in keep or e.store != store_id:  # another store's copy is not ours to judge
            return True
        return (e.commit not in drop and repo.index.has_commit(e.commit)
                and now - e.used < HOT_IDLE_S)

    try:
        dropped = m.engine().hot_tier().prune(wanted)
    except (InfinijupError, OSError) as exc:
        m.log.warning("infinijup: the hot tier was not pruned: %s", exc)
        return []
    if dropped:
        m.log.info("infinijup: dropped %d hot copies (%s)", len(dropped),
                   format_bytes(sum(e.bytes for e in dropped)))
    return dropped


async def stats(m) -> dict:  # noqa: ANN001 - the SnapshotManager
    """The store's size on disk and the hot tier's (``hot_bytes`` None: the helper, which
    knows where the tier is, did not answer)."""

    def run() -> dict:
        repo = m.repo()
        out = {"store_bytes": store_bytes(repo), "commits": repo.index.commit_count(),
               "threads": len(repo.threads()), "hot_bytes": None, "hot_entries": None,
               "hot_budget": m.hot_tier_bytes}
        try:
            hot = m.engine().hot_tier()
            out["hot_bytes"], out["hot_entries"] = hot.usage(), len(hot.entries())
        except (InfinijupError, OSError) as exc:
            m.log.info("infinijup: hot tier size unknown: %s", exc)
        out["text"] = f"Store {format_bytes(out['store_bytes'])}" + (
            f" · hot copies {format_bytes(out['hot_bytes'])}" if out["hot_bytes"] is not None
            else "")
        return out

    return await asyncio.to_thread(run)
