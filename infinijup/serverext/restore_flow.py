"""A restore, step by step: everything that can refuse refuses first (``plan``), then
images, GPU segments, endpoints, the helper's restore (it ends the old process), reconnect,
answer, adopt this session, resume hooks, head.

Each step leaves an undo, so that a restore that fails leaves the kernel as it was: the old
kernel if the helper had not ended it yet; a fresh one (every snapshot intact) if it had; a
hibernated kernel stays hibernated, to wake later. If the helper died while CRIU restored, the
tree CRIU went on to restore is adopted instead (``find_orphan``).

A lazy restore in place whose page files would stream from the store keeps the kernel it
replaces aside until the restored memory is back (aside.py); where that cannot be, the page
files are checked out first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .. import config, endpoints
from ..engine.file_behind import FileBehind
from ..engine.heads import head_after_restore
from ..engine.kernel_channel import run_agent, wait_answering, watch_activity_anew
from ..engine.lifecycle import RESTORING, RUNNING, SETTLING, Operation, Turn
from ..engine.naming import (
    DEFAULT_THREAD,
    check_thread_name,
    notebook_key,
    notebook_threads,
    store_thread,
)
from ..engine.orphans import find_restored_tree
from ..engine.reconnect import connections_to, wait_reconnected
from ..engine.retarget import (
    Retarget,
    adopt_expression,
    endpoint_paths,
    plan_retarget,
    saved_connection,
)
from ..engine.set_aside import SetAside, move_aside, move_back
from ..engine.steps import Steps
from ..errors import InfinijupError, RestoreFailed
from ..gpu import arena as gpu_arena
from ..gpu.restore_rules import plan_gpu_restore
from ..store.faults import holdpoint
from . import aside
from .history import check_new_thread, resolve
from .kernel_status import pages


@dataclass
class Plan:
    """What a restore will do, decided before anything is touched."""

    commit_id: str
    commit: object
    threads: dict[str, str]
    retarget: Retarget
    gpu_pairs: object


def plan(m, km, key: str, ref: str, branch: str | None, force: bool = False,  # noqa: ANN001
         gpu_map: dict[str, str] | None = None) -> Plan:
    """In a worker thread: what could refuse (unknown snapshot, a thread that exists, other
    endpoints or GPUs this kernel cannot take) refuses here."""
    holdpoint("restore_plan")  # tests: a resumed kernel started, its restore not yet begun
    repo = m.repo()
    if branch is not None:
        check_thread_name(branch)
    commit_id = resolve(repo, key, ref)
    commit = repo.get_commit(commit_id)
    threads = check_new_thread(repo, key, branch) if branch is not None else \
        notebook_threads(repo.threads(), key)
    meta = commit.metadata or {}
    retarget = plan_retarget(meta.get("connection") or {},
                             saved_connection(km.get_connection_info()))
    gpu_pairs = plan_gpu_restore(meta, force=force, requested=gpu_map)
    return Plan(commit_id, commit, threads, retarget, gpu_pairs)


async def restore(m, kernel_id: str, ref: str, *, branch: str | None = None,  # noqa: ANN001
                  wait_idle: bool = False, force: bool = False,
                  gpu_map: dict[str, str] | None = None, within: Turn | None = None,
                  quiet: bool = False, fresh: bool = False, park: bool = False) -> dict:
    """Restore snapshot ``ref`` into kernel ``kernel_id`` (``m`` is the SnapshotManager).
    ``within``: the turn of a larger move this restore is part of (a wake, an undo).
    ``quiet``: a step of an undo or redo (its events say so). ``fresh``: the kernel was
    started for this restore (a resume) and holds nothing of the user's. ``park``: the
    kernel is set aside alive, not ended; the answer's ``set_aside`` holds it (an undo dumps
    it afterwards: engine/set_aside.py); refused with reason ``cannot_park`` before anything
    is touched where it cannot be."""
    km = m.kernel(kernel_id)
    m.provisioner(km)
    path = await m.notebook_path(kernel_id)
    key = notebook_key(path)
    planned = await asyncio.to_thread(plan, m, km, key, ref, branch, force, gpu_map)
    turn = within or await m.lifecycle.begin(kernel_id, RESTORING)
    op = Operation("restore", kernel_id, path, quiet=quiet)
    m.lifecycle.start_operation(op)
    m.events.end(op, "queued")
    run = RestoreRun(m, km, op, turn, planned, key, branch, fresh)
    run.park = park
    run.may_keep = within is None and not park  # the replaced kernel, until the memory is back
    try:
        if wait_idle:
            await m.wait_idle(km)
        try:
            out = await run.run()
        except RestoreFailed as exc:
            # refused before anything was touched: the kernel cannot be kept aside, or its
            # owner may run no second tree (the helper's limit); the pages are checked out
            if not (run.keeps_replaced and exc.reason in ("cannot_park", "limit_reached")):
                raise
            m.log.info("infinijup: restore of %s checks the pages out first: %s", kernel_id,
                       exc.message)
            run = RestoreRun(m, km, op, turn, planned, key, branch, fresh)
            out = await run.run()
    except InfinijupError as exc:
        m.events.failed(op, exc)
        raise
    finally:
        km.session.key = run.session_key  # the session's key, whatever happened
        m.lifecycle.end_operation(op)
        if within is None and turn.state == RESTORING:
            if run.finished and run.keeps_replaced and run.set_aside is not None:
                turn.to(SETTLING)
                m.spawn(aside.keep_until_resident(m, run, run.set_aside, turn))
            elif run.finished:
                turn.to(RUNNING)
            else:
                turn.back()  # a hibernated (or released) kernel stays so
    if run.keeps_replaced:
        kept = out.pop("set_aside", None)
        out["kept_until_resident"] = kept.pid if kept is not None else None
    return out


class RestoreRun:
    def __init__(self, m, km, op: Operation, turn: Turn, planned: Plan, key: str,  # noqa: ANN001
                 branch: str | None, fresh: bool = False) -> None:
        self.m, self.km, self.op, self.turn, self.p = m, km, op, turn, planned
        self.fresh = fresh
        self.prov = km.provisioner
        self.key, self.branch = key, branch
        self.session_key = km.session.key
        self.finished = False
        self.park = False  # see restore()
        self.may_keep = False  # the kernel replaced may be kept until the memory is back
        self.keeps_replaced = False  # it is: the page files stream from the store (aside.py)
        self.set_aside: SetAside | None = None
        self.head_before = m.heads.get(km.kernel_id)
        self.connected: dict[str, set[int]] | None = None  # the server's, before the restore
        self.reconnect_to_kept = False  # the kernel set aside is this kernel again
        self.t0 = time.perf_counter()

    async def run(self) -> dict:
        try:
            return await self.steps()
        except BaseException:
            if self.reconnect_to_kept and self.connected is not None:
                # the kernel set aside is this kernel again: the server's connections to it
                # are back before the failure is answered (a request sent meanwhile would be
                # lost with a connection to the restored tree)
                await wait_reconnected(self.connected, self.m.answer_timeout)
            raise

    async def steps(self) -> dict:
        m, km, prov, p, op = self.m, self.km, self.prov, self.p, self.op
        kernel_id = km.kernel_id
        async with Steps(m.log) as step:
            m.events.emit(op, "store", 10)
            engine = m.engine()
            # The page files may stay in the store, read as the kernel runs (store_pages.py),
            # where no kernel of the user's is replaced (a damaged chunk found then ends the
            # restored kernel; a checkout finds it before anything is touched), or ...
            replaces = not self.fresh and prov.root_pid is not None
            source: dict = {"pages_may_stream": not replaces}
            if not replaces:  # GPU segments may follow the restore (engine/file_behind.py)
                source["behind"] = gpu_arena.IMAGE_NAME
            if replaces and self.may_keep:  # ... beside the kernel it replaces (aside.py)
                source["pages_may_stream"] = await asyncio.to_thread(
                    aside.may_keep_replaced, m, kernel_id, p.commit_id)
            images = await step("images", m.remote_tier.images(op, engine, p.commit_id, source))
            if replaces and source.get("pages_from_store"):
                self.park = self.keeps_replaced = True
            behind = source.get("file_behind")
            segments = await step("gpu_segments", self.gpu_segments(images, behind),
                                  undo=lambda: self.gpu_segments_done(segments, behind))
            info = km.get_connection_info()
            await step("endpoints", asyncio.to_thread(endpoints.check, info["ip"]))
            paths = endpoint_paths(info)
            connected = self.connected = connections_to(
                [paths[k] for k in ("shell_port", "iopub_port", "stdin_port", "control_port")])
            if p.retarget.saved_key is not None:  # it signs with its own key until adopted
                km.session.key = p.retarget.saved_key
            if self.park:  # its listeners' files go aside: the restored kernel binds anew
                moved = await step("set_aside", asyncio.to_thread(
                    move_aside, list(paths.values()), str(prov.root_pid)),
                    undo=lambda: asyncio.to_thread(move_back, moved))
            pid, phases = await step("restore", self.helper_restore(engine, images),
                                     undo=self.take_back if self.park else None)
            old = prov.attach(pid, keep_old=self.park)
            if self.park and old is not None:
                self.set_aside = SetAside(old, moved)
            m.events.emit(op, "reconnect", 85)
            reconnect_s = await step("reconnect", wait_reconnected(connected, m.answer_timeout))
            answer_s = await step("answer", self.answering(phases))
            if not p.retarget.same_session:
                await step("adopt", self.adopt(info))
            if behind is not None:
                await step("segments_behind", self.segments_behind(behind))
            await m.resume_hooks(km, restored=True, segments=segments)
            self.finished = True
            await self.gpu_segments_done(segments, behind)
        m.hibernation.restored(kernel_id)  # a hibernated kernel restored: awake
        commit_thread = (p.commit.metadata or {}).get("thread", DEFAULT_THREAD)
        if self.branch is not None:
            await asyncio.to_thread(m.repo().set_thread, store_thread(self.key, self.branch),
                                    p.commit_id, expected=None)
            p.threads[self.branch] = p.commit_id
        head = head_after_restore(p.commit_id, commit_thread, p.threads, self.branch)
        m.heads.set(kernel_id, head, prov)
        m.events.emit(op, "done", 100, commit=p.commit_id, thread=head.thread or "")
        return {"kernel_id": kernel_id, "commit": p.commit_id, "thread": head.thread,
                "duration_s": time.perf_counter() - self.t0,
                **({"set_aside": self.set_aside} if self.set_aside is not None else {}),
                "phases": {**phases, "checkout_s": source.get("checkout_s"),
                           **({"behind_s": behind.seconds} if behind is not None else {}),
                           "images": source.get("source"),
                           "pages_from_store": source.get("pages_from_store", False),
                           **({"pulled": source["pulled"]} if "pulled" in source else {}),
                           "reconnect_s": reconnect_s, "answer_s": answer_s}}

    # --- the steps ---------------------------------------------------------------------------
    async def take_back(self) -> None:
        """A restore beside a kernel set aside failed after the helper's part: the restored
        tree goes, the kernel set aside is this kernel again (its socket files go back by the
        set_aside step's undo, and the server reconnects to it)."""
        kept = self.set_aside
        if kept is None:
            return
        self.set_aside = None
        await self.prov.kill()
        self.prov.attach(kept.process)
        self.reconnect_to_kept = True

    async def gpu_segments(self, images, behind: FileBehind | None) -> str | None:  # noqa: ANN001
        """The snapshot's GPU segments, set aside (engine.restore removes the images); the
        restored kernel takes this copy. One still being checked out (``behind``) is named
        to the kernel once it is all there (:meth:`segments_behind`)."""
        self.token = ((self.p.commit.metadata or {}).get("gpu_segments") or {}).get("token")
        if behind is not None:
            return str(behind.path)
        segments = gpu_arena.set_aside(images)
        if segments is not None and self.token:
            gpu_arena.say_go(self.token, segments)
        return segments

    async def segments_behind(self, behind: FileBehind) -> None:
        """The segments checked out behind the restore: once they are all there and
        verified, the kernel is told where (it waits for that word in its resume hooks);
        if they cannot be read, the restored kernel, which would wait for them in vain, is
        ended (nothing was replaced: a wake stays hibernated, a new kernel goes)."""
        try:
            path = await behind.done()
        except BaseException:
            await self.prov.kill()
            raise
        if self.token:
            gpu_arena.say_go(self.token, str(path))

    async def gpu_segments_done(self, segments: str | None,
                                behind: FileBehind | None = None) -> None:
        if behind is not None:
            await behind.settled()  # its thread may still write the file
        if segments is not None:
            gpu_arena.discard(segments)
            if self.token:
                gpu_arena.forget_go(self.token)

    async def helper_restore(self, engine, images) -> tuple[int, dict]:  # noqa: ANN001
        """The helper ends the old process and CRIU restores the snapshot's tree."""
        m, km, prov, p = self.m, self.km, self.prov, self.p
        try:
            result = await asyncio.to_thread(
                engine.restore, images, prov.root_pid, m.events.progress(self.op), p.gpu_pairs,
                p.retarget.path_map, None if p.retarget.same_session else prov.log_path,
                self.park)
            return result.pid, result.phases
        except RestoreFailed as exc:
            self.reconnect_to_kept = getattr(exc, "parked", False)
            pid = await self.find_orphan(exc)
            if pid is None:
                km.session.key = self.session_key
                if not prov.hibernated:  # a hibernated kernel stays so, to wake later
                    await self.recover(exc)
                raise
            return pid, {"adopted": True}

    async def answering(self, phases: dict) -> float:
        try:
            if phases.get("pages"):  # memory still streaming in: its failure ends the wait
                return await self.answering_while_pages_stream()
            return await wait_answering(self.km, self.m.answer_timeout)
        except RestoreFailed as exc:
            if not phases.get("adopted"):
                raise
            await self.prov.kill()
            self.km.session.key = self.session_key
            await self.recover(exc)
            raise

    async def answering_while_pages_stream(self) -> float:
        """The kernel's first answer, or at once the reason its memory could not be brought
        back (the helper ended it: waiting the whole answer timeout would only hide why)."""
        answer = asyncio.ensure_future(wait_answering(self.km, self.m.answer_timeout))
        try:
            while not (await asyncio.wait({answer}, timeout=0.5))[0]:
                now = await pages(self.km)
                if now is not None and now.get("state") == "failed":
                    why = (now.get("error") or "the page daemon failed").splitlines()[0]
                    raise RestoreFailed(f"restore failed: the kernel's memory could not be "
                                        f"brought back ({why})", reason="pages_failed")
            return answer.result()
        finally:
            answer.cancel()

    async def adopt(self, info: dict) -> None:
        """The restored kernel takes this session's endpoints and key."""
        m, km, p = self.m, self.km, self.p
        expression = adopt_expression(km.kernel_id, m.serverapp.connection_url,
                                      str(config.results_dir()), km.connection_file or None,
                                      info["ip"], rekey=p.retarget.saved_key is not None)
        adopted = await run_agent(km, expression, m.busy_timeout, then_key=self.session_key)
        km.session.key = self.session_key  # the kernel signs with it from now on
        if p.retarget.saved_key is not None:
            watch_activity_anew(m.kernel_manager, km)
        if "error" in adopted:
            raise RestoreFailed("the restored kernel could not take this session's "
                                f"endpoints and key: {adopted['error']}")

    async def find_orphan(self, exc: RestoreFailed) -> int | None:
        """After the helper died mid-restore: the tree CRIU went on to restore, if any.

        The old kernel is gone by then (the helper kills it before CRIU starts). Adopting the
        restored tree finishes the restore the user asked for; leaving it would leave an
        untracked kernel holding this kernel's endpoints, so that no fresh kernel could start.
        """
        prov = self.prov
        if not getattr(exc, "tree_may_exist", False):
            return None
        if prov.tracked is not None and prov.tracked.alive():
            return None
        shell = endpoint_paths(self.km.get_connection_info())["shell_port"]
        pid = await asyncio.to_thread(find_restored_tree, shell)
        if pid is not None:
            self.m.log.warning("infinijup: the helper died during the restore of kernel %s; "
                               "adopting the tree it restored (pid %d)", self.km.kernel_id, pid)
        return pid

    async def recover(self, exc: RestoreFailed) -> None:
        """After a failed restore: keep the old kernel if it lives, else start a fresh one."""
        m, km, prov = self.m, self.km, self.prov
        if prov.tracked is not None and prov.tracked.alive():
            return
        m.log.warning("infinijup: restore failed (%s); restarting kernel %s fresh",
                      exc.message, km.kernel_id)
        if self.turn.state != RUNNING:
            self.turn.to(RUNNING)  # the restore is over: the restarter may see the kernel
        try:
            await m.kernel_manager.restart_kernel(km.kernel_id)
            m.heads.forget(km.kernel_id)
            exc.args = (f"{exc.message} (the kernel was restarted fresh; every snapshot is "
                        "intact)",)
        except Exception as restart_exc:
            exc.args = (f"{exc.message}; restarting the kernel failed too: {restart_exc}",)
            # Say so in the kernel's model (GET /api/kernels): it is dead until restarted.
            km.execution_state = "dead"
            km.reason = exc.message


async def restore_for_kernel(m, kernel_id: str, ref: str, branch: str | None) -> dict:  # noqa: ANN001
    """A restore the kernel asked for (``%restore``): starts once its cell has finished.
    What restore() would refuse is refused now: the %restore cell fails, not the next one."""
    km = m.kernel(kernel_id)
    m.provisioner(km)
    key = notebook_key(await m.notebook_path(kernel_id))
    planned = await asyncio.to_thread(plan, m, km, key, ref, branch)

    async def run() -> None:
        await asyncio.sleep(0.05)
        try:
            await restore(m, kernel_id, planned.commit_id, branch=branch, wait_idle=True)
        except InfinijupError as exc:
            m.log.warning("infinijup: restore asked by kernel failed: %s", exc.message)

    m.spawn(run())
    return {"kernel_id": kernel_id, "commit": planned.commit_id}
