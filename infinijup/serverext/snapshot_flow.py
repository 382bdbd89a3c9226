"""A snapshot, step by step: quiesce, plan, dump (the kernel runs again), store, record.

The kernel is frozen only from the dump's start to its end: as soon as CRIU has its images,
the kernel runs again (resume hooks; ``%snapshot``'s early answer) while the store takes the
images in, and the answer comes once the commit is durable. PyTorch's GPU segments, moved out
by the kernel before the dump (gpu_vmm.py), may come back as soon as the helper has given the
kernel its GPUs back (``GpuGo``).

Each step that changes the kernel leaves an undo: a snapshot that fails at any point leaves the
kernel running as it was, with its GPU segments and its parent's fingerprints.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

from .. import __version__, config
from ..engine import Head, plan_snapshot
from ..engine.extra_files import FileChanges
from ..engine.heads import SnapshotPlan, unchanged_since
from ..engine.kernel_channel import run_agent
from ..engine.lifecycle import HIBERNATED, RUNNING, SNAPSHOTTING, STORING, Operation, Turn
from ..engine.naming import check_thread_name, notebook_key, notebook_threads, store_thread
from ..engine.retarget import saved_connection
from ..engine.steps import Steps
from ..errors import Conflict, InfinijupError, PreflightRefused, SnapshotFailed
from ..gpu import arena as gpu_arena
from ..kernel_magics import agent


class GpuGo:
    """Tell the kernel, once, that it may map its GPU segments back (from any thread)."""

    def __init__(self, token: str | None) -> None:
        self.token, self._said, self._lock = token, False, threading.Lock()

    def say(self) -> None:
        with self._lock:
            if self.token and not self._said:
                self._said = True
                gpu_arena.say_go(self.token)


async def snapshot(m, kernel_id: str, *, message: str = "", thread: str | None = None,  # noqa: ANN001
                   from_kernel: bool = False, execution_count: int | None = None,
                   described: dict | None = None, request_id: str | None = None,
                   within: Turn | None = None, aside: str | None = None,
                   skip_unchanged: bool = False, auto: bool = False,
                   background: bool | None = None) -> dict:
    """Snapshot a kernel (``m`` is the SnapshotManager). ``within``: the turn of a larger move
    this snapshot is part of (a hibernation), which keeps the kernel's lifecycle state.

    ``aside``: a store ref. If the kernel is unchanged since the snapshot it stands on
    (heads.unchanged_since), this snapshot is kept on that ref instead of a thread of the
    notebook: it is no commit of the history, the kernel's head stays where it was, and the
    answer says ``"aside": true``.

    ``skip_unchanged``: a kernel unchanged since its head is not dumped at all: it runs on, and
    the answer is ``{"unchanged": true, "commit": <its head>}`` (undo.py asks so). ``auto``:
    the commit is marked automatic (issue 30). ``background``: nobody waits for the commit, so
    the store takes the images in niced (engine.snapshot); default: an automatic snapshot is
    (undo.py's save of the state it leaves is not: the user waits for it)."""
    km = m.kernel(kernel_id)
    prov = m.provisioner(km)
    if m.lifecycle.state(kernel_id) == HIBERNATED:
        raise Conflict("the kernel is hibernated: its last snapshot is its state (run a cell "
                       "to wake it)", reason="kernel_hibernated")
    if thread is not None:
        check_thread_name(thread)
    path = await m.notebook_path(kernel_id)
    turn = within or await m.lifecycle.begin(kernel_id, SNAPSHOTTING)
    op = Operation("snapshot", kernel_id, path,
                   quiet=auto or bool((described or {}).get("auto")))
    m.lifecycle.start_operation(op)
    m.events.end(op, "queued")
    run = SnapshotRun(m, km, prov, op, turn if within is None else None, path=path,
                      message=message, thread=thread, from_kernel=from_kernel,
                      execution_count=execution_count, described=described,
                      request_id=request_id, aside=aside)
    run.skip_unchanged, run.auto = skip_unchanged, auto
    run.background = background
    try:
        return await run.run()
    except InfinijupError as exc:
        m.events.failed(op, exc)
        raise
    finally:
        m.lifecycle.end_operation(op)
        if within is None and turn.state != RUNNING:
            turn.to(RUNNING)


class SnapshotRun:
    def __init__(self, m, km, prov, op: Operation, turn: Turn | None, *, path: str,  # noqa: ANN001
                 message: str, thread: str | None, from_kernel: bool,
                 execution_count: int | None, described: dict | None,
                 request_id: str | None, aside: str | None = None) -> None:
        self.m, self.km, self.prov, self.op, self.turn = m, km, prov, op, turn
        self.path, self.message, self.thread = path, message, thread
        self.from_kernel, self.execution_count = from_kernel, execution_count
        self.described, self.request_id = described, request_id
        self.head = m.heads.get(km.kernel_id)
        self.aside = aside  # the ref for a snapshot of an unchanged kernel (see snapshot())
        self.kept_aside = False
        self.skip_unchanged = False  # see snapshot()
        self.unchanged = False
        self.file_changes: FileChanges | None = None  # what the kernel said of its arena file
        self.auto = False
        self.background: bool | None = None  # see snapshot()
        self.plan = None
        self.resumed = False  # the kernel's resume hooks have run
        self.running_again_s: float | None = None
        self.quiesce_s: float | None = None
        self.gpu = GpuGo(None)  # (prepare: the kernel's own)
        self.t0 = time.perf_counter()

    async def run(self) -> dict:
        async with Steps(self.m.log) as step:
            target = await self.prepare(step)
            if self.unchanged:  # nothing to save: the kernel runs on, as it was
                return await self.goes_on_unchanged()
            result = await self.take(step, target)
        return self.record(result)

    async def prepare(self, step: Steps) -> dict:
        """Quiesce (unless the kernel did), describe and plan: the store target (``{}`` and
        ``self.unchanged`` for a kernel unchanged since its head, with ``skip_unchanged``)."""
        m, op = self.m, self.op
        if not self.from_kernel:  # %snapshot quiesced itself before asking
            m.events.emit(op, "quiesce", 10)
            info = await step("quiesce", self.quiesce(), undo=self.kernel_goes_on)
            self.execution_count, self.described = info.get("execution_count"), info
        self.quiesce_s = time.perf_counter() - self.t0
        refused = agent.refusal(self.described)
        if refused is not None:  # the kernel touched nothing: it runs on as it was
            raise PreflightRefused(refused[0], reason=refused[1])
        self.file_changes = FileChanges.parse((self.described or {}).get("gpu_segments"))
        self.described = agent.commit_metadata(self.described)
        token = self.described.get("gpu_segments", {}).get("token")
        self.gpu = gpu = GpuGo(token)
        await step("gpu_go", undo=lambda: asyncio.to_thread(gpu.say))
        return await step("plan", asyncio.to_thread(self.plan_now))

    async def goes_on_unchanged(self) -> dict:
        self.gpu.say()
        await self.kernel_goes_on()
        self.m.events.emit(self.op, "done", 100, commit=self.head.commit or "", thread="",
                           message="unchanged since its last snapshot: nothing taken")
        return {"unchanged": True, "commit": self.head.commit}

    async def take(self, step: Steps, target: dict):  # noqa: ANN201 - engine.DumpResult
        """Dump the kernel (it runs again at once) and store its images."""
        result = await step("store", await self.dump(step, target))
        if not self.from_kernel and not self.resumed:
            await self.m.resume_hooks(self.km, restored=False)
        return result

    async def dump(self, step: Steps, target: dict, replaced: bool = False) -> asyncio.Future:
        """Dump the kernel; once it runs again (or the dump failed), the store of its images
        as a future (engine.DumpResult). ``replaced``: a restore replaces the kernel next (an
        undo stores behind it), so it is not resumed (``resume``, if the restore fails)."""
        m, op, gpu = self.m, self.op, self.gpu
        extra = self.arena_files()
        m.events.emit(op, "dump", 30)
        loop = asyncio.get_running_loop()
        dumped_at: asyncio.Future = loop.create_future()

        def on_dumped(dumped) -> None:  # noqa: ANN001 - in the engine's thread
            gpu.say()
            loop.call_soon_threadsafe(dumped_at.set_result, (dumped, self.plan.thread))

        storing = asyncio.ensure_future(asyncio.to_thread(
            m.engine().snapshot, self.prov.root_pid, message=self.message,
            on_progress=self.progress(gpu), replan=self.replan, extra_files=extra,
            file_changes=self.file_changes if extra else None,
            on_dumped=on_dumped, background=self.is_auto() if self.background is None
            else self.background, **target))
        await asyncio.wait({dumped_at, storing}, return_when=asyncio.FIRST_COMPLETED)
        if dumped_at.done() and replaced:
            self.running_again_s = time.perf_counter() - self.t0
        elif dumped_at.done():  # the kernel runs again while its images are stored
            await step("runs_again", self.runs_again(*dumped_at.result()))
        return storing

    async def resume(self) -> None:
        """The kernel dumped for a restore that did not replace it goes on (its snapshot is
        still stored)."""
        if not self.resumed:
            self.resumed = True
            await self.m.resume_hooks(self.km, restored=False, committed=False)

    def record(self, result, head: bool = True) -> dict:  # noqa: ANN001 - engine.DumpResult
        """The commit stored: the kernel's head moves onto it (``head``: it stands there), and
        the answer."""
        m, op = self.m, self.op
        commit = result.commit
        if self.kept_aside:  # no commit of the history: the head stays
            m.remote_tier.committed(self.aside)  # a pod that goes wakes elsewhere from it
            m.events.emit(op, "done", 100, commit=commit.id, thread="")
        else:
            m.remote_tier.committed(store_thread(notebook_key(self.path), self.plan.thread))
            if head:
                m.heads.set(self.km.kernel_id, Head(commit=commit.id, thread=self.plan.thread,
                                                    base_thread=self.plan.thread), self.prov)
            m.events.emit(op, "done", 100, commit=commit.id, thread=self.plan.thread)
            if self.is_auto():
                m.retention.after_auto()  # older automatic snapshots thinned (retention.py)
        stats = {"image_bytes": result.image_bytes, "stored_bytes": result.stored_bytes,
                 "pause_s": result.pause_s, "quiesce_s": self.quiesce_s,
                 "running_again_s": self.running_again_s,
                 "store_s": result.phases.get("store_s"), "hot": result.hot,
                 "hot_s": result.phases.get("hot_s"), "read_bytes": result.read_bytes,
                 "duration_s": time.perf_counter() - self.t0}
        for key in ("gpu_release", "gpu_segments"):
            if self.described.get(key):
                stats[key] = self.described[key]
        return {"commit": commit.id, "thread": "" if self.kept_aside else self.plan.thread,
                "parents": list(commit.parents), "stats": stats,
                **({"aside": True} if self.kept_aside else {})}

    def is_auto(self) -> bool:
        return bool((self.described or {}).get("auto") or self.auto)

    # --- the steps ---------------------------------------------------------------------------
    def plan_now(self) -> dict:  # in a worker thread
        repo, km = self.m.repo(), self.km
        key = notebook_key(self.path)
        self.plan = plan = plan_snapshot(self.head, notebook_threads(repo.threads(), key),
                                         self.thread)
        same = self.head.commit is not None and (self.aside is not None or
                                                 self.skip_unchanged) and unchanged_since(
            repo.get_commit(self.head.commit).metadata or {}, self.execution_count,
            self.described or {}, cells_count=not self.skip_unchanged)
        if same and self.skip_unchanged:
            self.unchanged = True
            return {}
        if same:
            self.kept_aside = True
            tip = repo.threads().get(self.aside)
            self.plan = plan = SnapshotPlan(self.aside, (self.head.commit,), tip)
        metadata = {
            "notebook_path": self.path, "notebook_key": key, "thread": plan.thread,
            "kernel_id": km.kernel_id, "kernel_name": km.kernel_name,
            "execution_count": self.execution_count,
            "connection": saved_connection(km.get_connection_info()),
            "infinijup_version": __version__, "gpu": None, **(self.described or {}),
        }
        if self.auto:
            metadata["auto"] = True
        if self.kept_aside:
            metadata["thread"], metadata["aside"] = "", "unchanged since its parent"
            return {"thread": self.aside, "metadata": metadata,
                    "parents": list(plan.parents), "expected_tip": plan.expected_tip}
        return {"thread": store_thread(key, plan.thread), "metadata": metadata,
                "parents": list(plan.parents), "expected_tip": plan.expected_tip}

    def replan(self, _conflict) -> dict:  # noqa: ANN001 - in the engine's thread
        """The thread moved meanwhile (someone else snapshotted onto it): the same images go
        to a new thread (a snapshot kept aside: the ref as it is now)."""
        if self.kept_aside:
            return self.plan_now()
        self.head = Head(commit=self.head.commit, thread=None, base_thread=self.plan.thread)
        self.thread = None
        return self.plan_now()

    def arena_files(self) -> dict:
        """The kernel's GPU segments, moved to its arena before the dump, go with the images."""
        moved = (self.described or {}).get("gpu_segments", {})
        if not (moved.get("bytes") or moved.get("segment_bytes")):
            return {}
        arena = gpu_arena.segments_path(self.km.kernel_id)
        if arena is None:
            raise SnapshotFailed("snapshot failed: the kernel moved its GPU segments, but "
                                 "this server has no GPU arena", reason="gpu_arena")
        return {gpu_arena.IMAGE_NAME: arena}

    def progress(self, gpu: GpuGo):
        """The engine's progress, and the moment the helper gives the kernel its GPUs back
        (before it checks and publishes the images): the segments may come back then."""
        report = self.m.events.progress(self.op)

        def on_progress(phase: str, detail: dict) -> None:  # in the engine's thread
            if phase == "cuda_resume" and detail.get("state") == "done":
                gpu.say()
            report(phase, detail)

        return on_progress

    async def runs_again(self, dumped, thread_name: str) -> None:  # noqa: ANN001
        """Dumped: the kernel goes on while the store takes the images in."""
        self.running_again_s = time.perf_counter() - self.t0
        if self.turn is not None:
            self.turn.to(STORING)  # an operation asked for now waits for the store
        self.m.events.emit(self.op, "store", 60,
                           message="the kernel runs again; storing its images")
        if self.from_kernel:
            if self.request_id is not None:  # %snapshot returns now (unless it waits: -w)
                write_result(self.request_id, {
                    "dumped": True, "thread": thread_name,
                    "stats": {"image_bytes": dumped.image_bytes, "pause_s": dumped.pause_s}},
                    suffix=".dumped")
        else:
            self.resumed = True
            await self.m.resume_hooks(self.km, restored=False, committed=False)

    async def quiesce(self) -> dict:
        """The kernel's quiesce hooks and description, once its running cell has ended: a
        409 past ``busy_timeout`` or on ``cancel``; a quiesce that started just as the server
        gave up is undone when it answers (kernel_channel.run_agent)."""
        m = self.m
        deadline = time.time() + m.busy_timeout
        return await run_agent(self.km, agent.expression("quiesce", deadline), m.busy_timeout,
                               late=lambda _info: self.kernel_goes_on(),
                               cancel=self.op.cancel)

    async def kernel_goes_on(self) -> None:
        """No commit: the kernel keeps its parent's fingerprints, and runs on."""
        try:
            await run_agent(self.km, agent.expression("forget"), self.m.busy_timeout)
        except InfinijupError:
            pass
        if not self.resumed:
            await self.m.resume_hooks(self.km, restored=False)


def write_result(request_id: str, out: dict, suffix: str = "") -> None:
    """Where a kernel waits for the answer to what it asked (``%snapshot``)."""
    directory = Path(os.environ.get(config.RESULTS_DIR_ENV) or config.results_dir())
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = directory / f".{request_id}{suffix}.tmp"
    tmp.write_text(json.dumps(out))
    os.chmod(tmp, 0o600)
    os.replace(tmp, directory / f"{request_id}{suffix}.json")


async def snapshot_for_kernel(m, kernel_id, message, thread, request_id,  # noqa: ANN001
                              execution_count, described=None) -> dict:
    """A snapshot the kernel asked for (``%snapshot``): it waits on a result file."""
    m.kernel(kernel_id)

    async def run() -> None:
        try:
            out = await snapshot(m, kernel_id, message=message, thread=thread,
                                 from_kernel=True, execution_count=execution_count,
                                 described=described, request_id=request_id)
        except InfinijupError as exc:
            out = {"error": {"message": exc.message, "reason": exc.reason}}
        except Exception as exc:  # the kernel is waiting: it must hear back
            m.log.exception("infinijup: snapshot for kernel failed")
            out = {"error": {"message": str(exc), "reason": "internal_error"}}
        write_result(request_id, out)

    m.spawn(run())
    return {"request_id": request_id}
