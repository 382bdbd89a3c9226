"""Where each kernel is in its notebook's history (its head), branches, and the history the
panel draws.

A kernel's head is the commit its state came from and the thread its next snapshot goes to.
After a restart its state comes from no commit: the next snapshot is a new root, on a new
thread next to the old one (engine/heads.py).
"""

from __future__ import annotations

import asyncio

from ..engine import Head, plan_snapshot
from ..engine.naming import (
    DEFAULT_THREAD,
    check_thread_name,
    notebook_key,
    notebook_threads,
    store_thread,
)
from ..engine.retarget import why_not_retargetable
from ..errors import Conflict, InfinijupError
from ..gpu.restore_rules import plan_gpu_restore
from ..store.errors import UnknownRef
from ..store.objects import is_hex_id
from ..store.thinned import thinned


class Heads:
    """Each kernel's head, valid while the kernel keeps the process it had when it was set."""

    def __init__(self, kernel_manager) -> None:  # noqa: ANN001
        self.kernel_manager = kernel_manager
        self._heads: dict[str, Head] = {}
        self._launches: dict[str, int] = {}  # kernel id -> provisioner launches at its head

    def get(self, kernel_id: str | None) -> Head:
        head = self._heads.get(kernel_id) if kernel_id else None
        if head is None:
            return Head(commit=None, thread=DEFAULT_THREAD)
        km = self.kernel_manager.get_kernel(kernel_id) if kernel_id in \
            self.kernel_manager.list_kernel_ids() else None
        launches = getattr(getattr(km, "provisioner", None), "launches", None)
        if launches is not None and launches != self._launches.get(kernel_id, launches):
            return Head(commit=None, thread=head.thread or head.base_thread)
        return head

    def set(self, kernel_id: str, head: Head, prov) -> None:  # noqa: ANN001
        self._heads[kernel_id] = head
        self._launches[kernel_id] = getattr(prov, "launches", 0)

    def forget(self, kernel_id: str) -> None:
        self._heads.pop(kernel_id, None)

    def commits(self) -> set[str]:
        """The commits some kernel of this server stands on (copies: safe from any thread)."""
        return {h.commit for h in list(self._heads.values()) if h.commit}


def resolve(repo, key: str, ref: str) -> str:  # noqa: ANN001
    """A notebook's thread name, a commit id (or prefix) or a store ref, as a commit id."""
    threads = notebook_threads(repo.threads(), key)
    if ref in threads:
        return threads[ref]
    try:
        return repo.resolve(ref)
    except UnknownRef as exc:
        if not is_hex_id(ref):
            raise
        raise UnknownRef(f"{exc.message} in this store: a snapshot of another machine "
                         f"comes here with `infinijup store pull REMOTE {ref}`") from None


def check_new_thread(repo, key: str, name: str) -> dict[str, str]:  # noqa: ANN001
    """The notebook's threads, if ``name`` can be a new one among them (else 409)."""
    check_thread_name(name)
    threads = notebook_threads(repo.threads(), key)
    if name in threads:
        raise Conflict(f"thread '{name}' already exists", reason="thread_exists")
    return threads


async def branch(m, kernel_id: str, name: str) -> dict:  # noqa: ANN001 - the SnapshotManager
    m.kernel(kernel_id)
    check_thread_name(name)
    key = notebook_key(await m.notebook_path(kernel_id))
    await asyncio.to_thread(check_new_thread, m.repo(), key, name)
    head = m.heads.get(kernel_id)
    if head.commit is not None:
        await asyncio.to_thread(m.repo().set_thread, store_thread(key, name), head.commit,
                                expected=None)
    m.heads.set(kernel_id, Head(commit=head.commit, thread=name, base_thread=name),
                m.kernel(kernel_id).provisioner)
    return {"kernel_id": kernel_id, "thread": name, "commit": head.commit}


def session_connection() -> dict:
    """What a new Infinijup kernel of this server is sure to have: its transport (its key
    and endpoints are its own, and a restore moves the snapshot's to them)."""
    return {"transport": "ipc"}


def why_not_resumable(c) -> str | None:  # noqa: ANN001
    """Why commit ``c`` cannot be resumed into a new kernel here (None: it can)."""
    meta = c.metadata or {}
    why_not = why_not_retargetable(meta.get("connection") or {}, session_connection())
    if why_not is not None:
        return why_not
    try:
        plan_gpu_restore(meta)
    except InfinijupError as exc:
        return exc.message
    return None


THINNED = ("thinned: an automatic snapshot kept only in the history (its images went with "
           "age); restore a newer or older one")


def commit_json(c, not_resumable: str | None = None) -> dict:  # noqa: ANN001
    meta = dict(c.metadata or {})
    meta.pop("connection", None)  # holds the kernel's HMAC key: never leaves the server
    stats = {k: v for k, v in dict(getattr(c, "stats", {}) or {}).items()
             if k in ("image_bytes", "stored_bytes")}
    timings = meta.get("timings") or {}
    stats["pause_s"] = timings.get("dump_s", 0.0)
    gpu = meta.get("gpu") or {}
    stats["gpu_bytes"] = int(sum((gpu.get("vram_bytes") or {}).values())) if gpu else 0
    return {"id": c.id, "parents": list(c.parents), "thread": meta.get("thread", ""),
            "message": c.message, "created": c.created, "metadata": meta, "stats": stats,
            "resumable": not_resumable is None, "resumable_reason": not_resumable}


def history(repo, path: str, head: Head, remote_only: set[str] | dict) -> dict:  # noqa: ANN001
    """A notebook's commits, newest first, its threads and where its kernel stands."""
    key = notebook_key(path)
    gone = thinned(repo)
    threads = notebook_threads(repo.threads(), key)
    commits: dict[str, object] = {}
    for name in threads:
        for c in repo.log(store_thread(key, name)):
            commits.setdefault(c.id, c)
    if head.commit and head.commit not in commits:
        # The kernel came from another notebook's snapshot ("Open in new notebook", a resume
        # by id): it shows, marked with its notebook, until this notebook's first snapshot
        # (whose parent it is) brings its lineage in.
        try:
            commits[head.commit] = repo.get_commit(head.commit)
        except InfinijupError:
            pass
    ordered = sorted(commits.values(), key=lambda c: c.created, reverse=True)
    # Where the next snapshot goes, planned as a snapshot would plan it (the UI shows it).
    next_thread = plan_snapshot(head, threads, None).thread
    return {
        "path": path,
        "commits": [{**commit_json(c, THINNED if c.id in gone else why_not_resumable(c)),
                     "remote_only": c.id in remote_only,
                     **({"thinned": True} if c.id in gone else {}),
                     **_elsewhere(c, key)} for c in ordered],
        "threads": threads,
        "head": {"thread": head.thread, "commit": head.commit, "next_thread": next_thread},
    }


def _elsewhere(c, key: str) -> dict:  # noqa: ANN001
    """``{"notebook": path}`` for a commit of another notebook (shown where a kernel came from)."""
    meta = c.metadata or {}
    if meta.get("notebook_key", key) == key:
        return {}
    return {"notebook": meta.get("notebook_path") or ""}
