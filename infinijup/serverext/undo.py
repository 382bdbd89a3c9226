"""Undo and redo of cells (issue 30), on the snapshots the kernel already has.

Undo brings the kernel back to the state before the last cell that changed it: the newest
snapshot (automatic or not) taken before that cell ran. Nothing is lost on the way:

* a kernel changed since the snapshot it stands on (HEAD) is snapshotted first (marked
  automatic, "before undo"), so the state being left is kept; it becomes where a redo goes, and
  the undo goes to HEAD: the cells since were too quick to snapshot, and all of them go;
* a kernel unchanged since HEAD goes to HEAD's parent, and a redo returns to HEAD.

Each undo pushes where it came from on the kernel's redo list; redo pops it (saving the state
it leaves in the same way), and an undo after a redo goes on from there. Going back to an older
snapshot is a restore like any other: the next snapshot starts a new thread (a branch), so the
path undone stays in the history.

An undo or redo asked for by the kernel itself (``%undo``) runs once the asking cell is done.

Redo lists outlive the server: each is kept in a record beside the store
(``<store>-redo/<kernel id>.json``: the notebook's path and the commits), written at each undo
and redo. A kernel with no list of its own (the first kernel of a notebook in a new server, or
one standing in for a hibernated kernel) takes over the newest record of its notebook whose
kernel is not running here, so undo, server restart, redo works. Retention (retention.py)
spares every commit a record names. A record goes when its list is used up; closing a notebook
keeps it (its commits stay spared until the notebook's next kernel redoes them or undoes anew).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ..errors import Conflict, InfinijupError
from ..store.thinned import thinned
from . import kernel_records, snapshot_flow


class UndoRedo:
    def __init__(self, manager, records: Path | None = None) -> None:  # noqa: ANN001
        self.m = manager  # the SnapshotManager
        store = Path(manager.store_path)
        self.records = records or store.with_name(store.name + "-redo")
        self.redo_lists: dict[str, list[str]] = {}  # kernel id -> commits to go back to
        self.paths: dict[str, str] = {}  # kernel id -> its notebook (as its record says)

    async def undo(self, kernel_id: str, from_kernel: bool = False) -> dict:
        return await self._run(kernel_id, "undo", from_kernel)

    async def redo(self, kernel_id: str, from_kernel: bool = False) -> dict:
        return await self._run(kernel_id, "redo", from_kernel)

    def forget(self, kernel_id: str) -> None:
        self.redo_lists.pop(kernel_id, None)
        self.paths.pop(kernel_id, None)
        self._remove_record(kernel_id)

    def protected(self) -> set[str]:
        """Every commit a redo would go back to: this server's lists and every record."""
        out = {c for commits in self.redo_lists.values() for c in commits}
        for record in self._records():
            out.update(record["commits"])
        return out

    # --- records -----------------------------------------------------------------------------
    async def _load(self, kernel_id: str) -> list[str]:
        """The kernel's redo list: its own, or taken over from its notebook's record."""
        if kernel_id in self.redo_lists:
            return self.redo_lists[kernel_id]
        path = await self.m.notebook_path(kernel_id)
        running = set(self.m.kernel_ids()) - {kernel_id}
        found = [r for r in self._records() if r.get("path") == path
                 and r.get("kernel_id") not in running]
        commits: list[str] = []
        if found:
            record = max(found, key=lambda r: r.get("updated") or 0)
            commits = list(record["commits"])
            self.m.log.info("infinijup: kernel %s takes over the redo list of %s (%d)",
                            kernel_id, record.get("kernel_id"), len(commits))
        self.redo_lists[kernel_id], self.paths[kernel_id] = commits, path
        if found:
            self._save(kernel_id)
            if record.get("kernel_id") != kernel_id:
                self._remove_record(str(record.get("kernel_id")))
        return commits

    def _save(self, kernel_id: str) -> None:
        commits = self.redo_lists.get(kernel_id)
        if not commits:
            self._remove_record(kernel_id)
            return
        kernel_records.write(self.records, kernel_id, {
            "kernel_id": kernel_id, "path": self.paths.get(kernel_id), "commits": commits,
            "updated": time.time()})

    def _remove_record(self, kernel_id: str) -> None:
        kernel_records.remove(self.records, kernel_id)

    def _records(self) -> list[dict]:
        return kernel_records.read_all(self.records, lambda r: isinstance(
            r.get("commits"), list) and all(isinstance(c, str) for c in r["commits"]))

    async def _run(self, kernel_id: str, what: str, from_kernel: bool) -> dict:
        m = self.m
        km = m.kernel(kernel_id)
        m.provisioner(km)
        if what == "undo" and m.heads.get(kernel_id).commit is None:
            raise Conflict("nothing to undo: this kernel stands on no snapshot (take one, or "
                           "turn automatic snapshots on)", reason="nothing_to_undo")
        if what == "redo" and not await self._load(kernel_id):
            raise Conflict("nothing to redo", reason="nothing_to_redo")
        if not from_kernel:
            return await self._now(kernel_id, what)

        async def later() -> None:  # once the cell that asked has ended
            await asyncio.sleep(0.05)
            try:
                await m.wait_idle(km)
                await self._now(kernel_id, what)
            except InfinijupError as exc:
                m.log.warning("infinijup: %%%s of %s failed: %s", what, kernel_id, exc.message)

        m.spawn(later())
        return {"kernel_id": kernel_id, "says": what.capitalize()}

    async def _now(self, kernel_id: str, what: str) -> dict:
        m = self.m
        km = m.kernel(kernel_id)
        await m.wait_idle(km)
        t0 = time.perf_counter()
        # the user waits for it: stored at the server's priority, not niced as a background
        # automatic snapshot is
        saved = await snapshot_flow.snapshot(m, kernel_id, message=f"before {what}",
                                             skip_unchanged=True, auto=True, background=False)
        save_s = time.perf_counter() - t0
        here = saved["commit"]  # the state being left: HEAD, or the snapshot just taken
        repo = m.repo()
        redo = await self._load(kernel_id)
        if what == "redo":
            gone = thinned(repo)
            while redo and (redo[-1] in gone or not repo.index.has_commit(redo[-1])):
                # deleted from the panel since (or thinned by a server that had no record)
                m.log.warning("infinijup: redo of %s skips %s: no longer in the store",
                              kernel_id, redo.pop()[:12])
                self._save(kernel_id)
            if not redo:
                raise Conflict("nothing to redo: the states undone are no longer in the "
                               "store", reason="nothing_to_redo")
            target = redo[-1]
        else:
            # unchanged: HEAD's parent; changed: the snapshot just taken stands on HEAD, and
            # the cells since HEAD (too quick to snapshot) all go
            parents = repo.get_commit(here).parents
            gone = thinned(repo)  # automatic snapshots thinned with age: further back
            while parents and parents[0] in gone:
                parents = repo.get_commit(parents[0]).parents
            if not parents:
                raise Conflict("nothing to undo: the kernel is at the first snapshot of its "
                               "history", reason="nothing_to_undo")
            target = parents[0]
        result = await m.restore_keeping_settings(kernel_id, target, quiet=True)
        if what == "undo":
            redo.append(here)
        elif redo and redo[-1] == target:  # taken off only once the restore is done
            redo.pop()
        self._save(kernel_id)
        says = describe_move(what, _cell(repo, here), _cell(repo, target))
        return {**result, "phases": {**result.get("phases", {}), "save_s": save_s},
                "from": here, "saved": not saved.get("unchanged"), "says": says}


def _cell(repo, commit_id: str) -> tuple[int | None, str]:  # noqa: ANN001
    meta = repo.get_commit(commit_id).metadata or {}
    cell = meta.get("cell") or {}
    count = cell.get("execution_count")
    return (count if isinstance(count, int) else None, str(cell.get("source") or ""))


def describe_move(what: str, here: tuple[int | None, str], there: tuple[int | None, str]) -> str:
    """"Back to after [11] df = load()", "3 cells back, to after [11] …: cells [12]-[13] were
    too quick to snapshot", "Redone: after [14] …"."""
    (h, _), (t, source) = here, there
    after = f"after [{t}] {source}".rstrip() if t is not None else "a snapshot with no cell"
    if what == "redo":
        return f"Redone: back to {after}"
    if h is None or t is None or h - t <= 1:
        return f"Back to {after}"
    n = h - t
    quick = f"cell [{t + 1}] was" if n == 2 else f"cells [{t + 1}]-[{h - 1}] were"
    return f"{n} cells back, to {after}: {quick} too quick to snapshot"
