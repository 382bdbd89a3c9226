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
A hibernated kernel is its last snapshot, unchanged: its undo or redo is a restore, which wakes
it there.

Saving the state left made the user wait for its dump and store (an undo took 14x a restore).
Now the state left is stored behind the restored kernel, which answers meanwhile. Where it can,
the kernel left is set aside (engine/set_aside.py): quiesced and planned as a snapshot, it
stays alive while the snapshot goes back in beside it, and is dumped, stored and ended behind
the restored kernel. Where it cannot be (no PID namespace, GPU state, too little free memory,
or ``undo_sets_aside`` off), it is dumped first (the kernel is frozen for that), then the
restore replaces it while its images are stored (``undo_stores_behind``; off: the store is
waited for first). Until that commit lands the kernel is ``storing``: a redo, undo or
snapshot asked for then waits for it. If the late store fails, the failure is reported once
and there is nothing to redo: the kernel the user has was never at risk. If the restore fails
after it had ended a kernel dumped first, the kernel goes back to the state it left once that
is stored.

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

from ..engine.lifecycle import HIBERNATED, RESTORING, RUNNING, STORING, Operation
from ..engine.set_aside import SetAside
from ..engine.steps import Steps
from ..errors import Conflict, InfinijupError, RestoreFailed
from ..store.faults import holdpoint
from ..store.thinned import thinned
from . import aside, kernel_records, snapshot_flow
from .kernel_status import pages


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
        await m.lifecycle.settled(kernel_id)  # a state an undo left, still being stored
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
        if m.lifecycle.state(kernel_id) == RUNNING:
            park = await asyncio.to_thread(self.may_set_aside, kernel_id)
            return await self._move(kernel_id, what, park)
        t0 = time.perf_counter()
        if m.lifecycle.state(kernel_id) == HIBERNATED:
            # its last snapshot is its state, unchanged (hibernation.py): the restore wakes it
            saved = {"commit": m.heads.get(kernel_id).commit, "unchanged": True}
        else:
            # the user waits for it: stored at the server's priority, not niced as a
            # background automatic snapshot is
            saved = await snapshot_flow.snapshot(m, kernel_id, message=f"before {what}",
                                                 skip_unchanged=True, auto=True,
                                                 background=False)
        save_s = time.perf_counter() - t0
        here = saved["commit"]  # the state being left: HEAD, or the snapshot just taken
        repo = m.repo()
        await self._load(kernel_id)
        if what == "redo":
            target = self._target(kernel_id, what, here)
        else:
            # unchanged: HEAD's parent; changed: the snapshot just taken stands on HEAD, and
            # the cells since HEAD (too quick to snapshot) all go
            parents = repo.get_commit(here).parents
            if not parents:
                raise Conflict("nothing to undo: the kernel is at the first snapshot of its "
                               "history", reason="nothing_to_undo")
            target = self._target(kernel_id, what, parents[0])
        result = await m.restore_keeping_settings(kernel_id, target, quiet=True)
        self._moved(kernel_id, what, here, target)
        return self._answer(result, what, _cell(repo, here), target, save_s,
                            saved=not saved.get("unchanged"), here=here)

    def _target(self, kernel_id: str, what: str, start: str) -> str:
        """Where the move goes: a redo, to the newest state on the list still in the store;
        an undo, to ``start`` or the nearest older snapshot not thinned away."""
        repo = self.m.repo()
        gone = thinned(repo)  # automatic snapshots thinned with age: further back
        if what == "redo":
            redo = self.redo_lists.get(kernel_id) or []
            while redo and (redo[-1] in gone or not repo.index.has_commit(redo[-1])):
                # deleted from the panel since (or thinned by a server that had no record)
                self.m.log.warning("infinijup: redo of %s skips %s: no longer in the store",
                                   kernel_id, redo.pop()[:12])
                self._save(kernel_id)
            if not redo:
                raise Conflict("nothing to redo: the states undone are no longer in the "
                               "store", reason="nothing_to_redo")
            return redo[-1]
        at: str | None = start
        while at is not None and at in gone:
            parents = repo.get_commit(at).parents
            at = parents[0] if parents else None
        if at is None:
            raise Conflict("nothing to undo: the kernel is at the first snapshot of its "
                           "history", reason="nothing_to_undo")
        return at

    def _moved(self, kernel_id: str, what: str, here: str | None, target: str) -> None:
        """The restore is done: the redo list says so (an undo's ``here`` may come later)."""
        redo = self.redo_lists.setdefault(kernel_id, [])
        if what == "undo" and here is not None:
            redo.append(here)
        elif what == "redo" and redo and redo[-1] == target:  # off once the restore is done
            redo.pop()
        self._save(kernel_id)

    # --- undo beside the kernel it leaves ------------------------------------------------------
    def may_set_aside(self, kernel_id: str) -> bool:
        """Whether the kernel may be set aside while the undo restores (in a worker thread):
        the setting, and aside.py's check, for a second copy of the kernel (its size at its
        head or now, whichever is more)."""
        m = self.m
        if not getattr(m, "undo_sets_aside", True) or m.lifecycle.state(kernel_id) != RUNNING:
            return False  # (a hibernated or released kernel: the way before says why not)
        head = m.heads.get(kernel_id).commit
        if head is None:
            return False
        return aside.may_set_aside(m, kernel_id, [head], aside.kernel_size(m, kernel_id, head))

    async def _move(self, kernel_id: str, what: str, park: bool) -> dict:
        """The move of a running kernel, its state left stored behind the restored kernel
        (module docstring): set aside alive (``park``) or dumped first."""
        m = self.m
        km = m.kernel(kernel_id)
        prov = m.provisioner(km)
        path = await m.notebook_path(kernel_id)
        turn = await m.lifecycle.begin(kernel_id, RESTORING)
        op = Operation("snapshot", kernel_id, path, quiet=True)
        run = snapshot_flow.SnapshotRun(
            m, km, prov, op, None, path=path, message=f"before {what}", thread=None,
            from_kernel=False, execution_count=None, described=None, request_id=None)
        run.skip_unchanged = run.auto = run.background = True
        t0 = time.perf_counter()
        kept: SetAside | None = None
        await self._load(kernel_id)
        try:
            async with Steps(m.log) as step:
                m.lifecycle.start_operation(op)
                try:
                    planned = await run.prepare(step)
                finally:
                    m.lifecycle.end_operation(op)
                head = m.heads.get(kernel_id).commit
                repo = m.repo()
                parents = repo.get_commit(head).parents if head is not None else []
                if head is None or (run.unchanged and what == "undo" and not parents):
                    raise Conflict("nothing to undo: the kernel is at the first snapshot of "
                                   "its history", reason="nothing_to_undo")
                # unchanged: an undo goes to HEAD's parent; changed: to HEAD (the cells
                # since, too quick to snapshot, all go)
                start = parents[0] if run.unchanged and what == "undo" else head
                target = self._target(kernel_id, what, start)
                if run.unchanged:
                    here_cell = _cell(repo, head)
                    await run.goes_on_unchanged()
                    save_s = time.perf_counter() - t0
                    result = await m.restore_keeping_settings(kernel_id, target, quiet=True,
                                                              within=turn)
                    self._moved(kernel_id, what, head if what == "undo" else None, target)
                    turn.to(RUNNING)
                    return self._answer(result, what, here_cell, target, save_s, saved=False,
                                        here=head)
                here_cell = _meta_cell(planned.get("metadata") or {})
                save_s = time.perf_counter() - t0
                if not park:
                    return await self._dumped_first(step, run, planned, turn, kernel_id, what,
                                                    target, here_cell, t0)
                try:
                    result = await m.restore_keeping_settings(kernel_id, target, quiet=True,
                                                              within=turn, park=True)
                except RestoreFailed as exc:
                    if exc.reason != "cannot_park":
                        raise
                    m.log.info("infinijup: %s of %s dumps the state it leaves first: %s",
                               what, kernel_id, exc.message)
                    return await self._dumped_first(step, run, planned, turn, kernel_id, what,
                                                    target, here_cell, t0)
                kept = result.pop("set_aside", None)
        except BaseException:
            if turn.state == RESTORING:
                turn.back()
            raise
        self._moved(kernel_id, what, None, target)
        if kept is None:  # (the helper ended it after all)
            turn.to(RUNNING)
        else:
            turn.to(STORING)
            m.spawn(self._store_aside(run, planned, kept, turn, kernel_id, what))
        return self._answer(result, what, here_cell, target, save_s, saved=True, here=None)

    async def _dumped_first(self, step: Steps, run, planned: dict, turn, kernel_id: str,  # noqa: ANN001
                            what: str, target: str, here_cell, t0: float) -> dict:
        """The kernel cannot be set aside: it is dumped (still quiesced), then the restore
        replaces it while its images are stored. With ``undo_stores_behind`` off, the store
        is waited for before the restore."""
        m = self.m
        behind = getattr(m, "undo_stores_behind", True)
        m.lifecycle.start_operation(run.op)
        try:
            storing = await run.dump(step, planned, replaced=behind)
            if not behind:
                stored = run.record(await step("store", storing))
            elif storing.done() and storing.exception() is not None:
                storing.result()  # the dump failed: the kernel goes on (step undo)
        except BaseException:
            m.lifecycle.end_operation(run.op)
            raise
        save_s = time.perf_counter() - t0
        if not behind:
            m.lifecycle.end_operation(run.op)
            result = await m.restore_keeping_settings(kernel_id, target, quiet=True,
                                                      within=turn)
            self._moved(kernel_id, what, stored["commit"], target)
            turn.to(RUNNING)
            return self._answer(result, what, here_cell, target, save_s, saved=True,
                                here=stored["commit"])
        old = m.provisioner(m.kernel(kernel_id)).tracked
        try:
            result = await m.restore_keeping_settings(kernel_id, target, quiet=True,
                                                      within=turn)
        except InfinijupError as exc:
            await self._way_back(run, storing, turn, kernel_id, old, exc)
            raise
        except BaseException:
            m.spawn(self._stored_behind(run, storing, None, kernel_id, None))
            raise
        self._moved(kernel_id, what, None, target)
        turn.to(STORING)
        m.spawn(self._stored_behind(run, storing, turn, kernel_id, what))
        return self._answer(result, what, here_cell, target, save_s, saved=True, here=None)

    async def _way_back(self, run, storing: asyncio.Future, turn, kernel_id: str,  # noqa: ANN001
                        old, exc: InfinijupError) -> None:
        """The restore of a move that dumped first failed. If the kernel dumped runs on, so be
        it (its images are still stored, on no list). If the restore had ended it, the kernel
        goes back to the state it left once that is stored; ``exc`` says how it went."""
        m = self.m
        prov = m.provisioner(m.kernel(kernel_id))
        if old is not None and prov.tracked is old and old.alive():
            await run.resume()
            m.spawn(self._stored_behind(run, storing, None, kernel_id, None))
            return
        stored = await self._stored_behind(run, storing, None, kernel_id, None)
        if stored is None:
            exc.args = (f"{exc.message}; the state it left could not be stored",)
            return
        try:
            if turn.state == RUNNING:
                turn.to(RESTORING)
            await m.restore_keeping_settings(kernel_id, stored["commit"], quiet=True,
                                             within=turn)
            exc.args = (f"{exc.message}; the kernel was then brought back to the state it "
                        f"left (snapshot {stored['commit'][:12]})",)
        except InfinijupError as back:
            exc.args = (f"{exc.message}; going back to the state it left (snapshot "
                        f"{stored['commit'][:12]}) failed too: {back.message}",)
        finally:
            if turn.state == RESTORING:
                turn.to(RUNNING)

    def _answer(self, result: dict, what: str, here_cell, target: str, save_s: float,  # noqa: ANN001
                *, saved: bool, here: str | None) -> dict:
        """``from``: the commit of the state left (None while it is still being stored:
        ``saving``)."""
        says = describe_move(what, here_cell, _cell(self.m.repo(), target))
        return {**result, "phases": {**result.get("phases", {}), "save_s": save_s},
                "from": here, "saved": saved, "saving": saved and here is None, "says": says}

    async def _store_aside(self, run, planned: dict, kept: SetAside, turn,  # noqa: ANN001
                           kernel_id: str, what: str) -> None:
        """Behind the restored kernel: dump the kernel set aside (which ends it), store it as
        the state left, and put it on the redo list. Its failure is reported once; the
        kernel set aside is ended either way, before the kernel runs on."""
        m, op = self.m, run.op
        m.lifecycle.start_operation(op)
        m.kept_aside[kernel_id] = kept  # a stopping server ends it (aside.end_all_kept)

        async def dumped_and_stored():  # noqa: ANN202 - engine.DumpResult
            try:
                km = m.kernel(kernel_id)
                for _ in range(600):  # the restored kernel's memory first (it streams in)
                    now = await pages(km)
                    if now is None or now.get("state") != "streaming":
                        break
                    await asyncio.sleep(0.2)
                await asyncio.to_thread(holdpoint, "set_aside")  # (tests hold it here)
                m.events.emit(op, "dump", 30)
                return await asyncio.to_thread(
                    m.engine().snapshot, kept.pid, message=run.message,
                    on_progress=m.events.progress(op), replan=run.replan, background=True,
                    leave_running=False, **planned)
            finally:
                aside.let_go(m, kernel_id, kept)
                await aside.end_kept(m, kept)

        await self._stored_behind(run, asyncio.ensure_future(dumped_and_stored()), turn,
                                  kernel_id, what)

    async def _stored_behind(self, run, storing: asyncio.Future, turn, kernel_id: str,  # noqa: ANN001
                             what: str | None) -> dict | None:
        """The state a move left, once stored: recorded (the kernel's head stays where the
        move took it) and, after an undo, put on the redo list. A failure is reported once;
        there is then nothing to redo. ``turn`` (the kernel ``storing``) runs again after."""
        m, op = self.m, run.op
        try:
            stored = run.record(await storing, head=False)
            if what == "undo":
                self.redo_lists.setdefault(kernel_id, []).append(stored["commit"])
                self._save(kernel_id)
            return stored
        except Exception as exc:  # noqa: BLE001 - reported once; the user's kernel runs on
            message = getattr(exc, "message", str(exc))
            m.log.warning("infinijup: the state %s of %s left could not be stored (%s); there "
                          "is nothing to redo to", what or "a move", kernel_id, message)
            m.events.failed(op, exc)
            return None
        finally:
            m.lifecycle.end_operation(op)
            if turn is not None and turn.state == STORING:
                turn.to(RUNNING)


def _cell(repo, commit_id: str) -> tuple[int | None, str]:  # noqa: ANN001
    return _meta_cell(repo.get_commit(commit_id).metadata or {})


def _meta_cell(meta: dict) -> tuple[int | None, str]:
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
