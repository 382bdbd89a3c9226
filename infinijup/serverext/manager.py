"""The snapshot manager: Jupyter's kernels on one side, the snapshot engine on the other.

One operation at a time per kernel (a second gets 409). Each phase change is published on
jupyter_server's event bus. Blocking work (helper calls, store I/O) runs in threads so the
server keeps serving while a kernel is dumped.

A snapshot resumes the kernel as soon as it is dumped (resume hooks; ``%snapshot`` gets an
early answer) and stores the images meanwhile; it answers once the commit is durable.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

from traitlets import Bool, Float, Integer, Unicode, default, observe
from traitlets.config import LoggingConfigurable

from .. import __version__, config, endpoints
from ..engine import Head, SnapshotEngine, plan_snapshot
from ..engine.heads import head_after_restore
from ..engine.hot_tier import default_budget
from ..engine.kernel_channel import run_agent, wait_answering, watch_activity_anew
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
    adopt_expression,
    endpoint_paths,
    plan_retarget,
    saved_connection,
    why_not_retargetable,
)
from ..errors import (
    BadRequest,
    Conflict,
    InfinijupError,
    NotFound,
    PreflightRefused,
    RestoreFailed,
    SnapshotFailed,
)
from ..gpu import arena as gpu_arena
from ..gpu import room, room_plan
from ..gpu.restore_rules import plan_gpu_restore
from ..helper_client import HelperClient
from ..kernel_magics import agent
from ..provisioner import InfinijupProvisioner
from ..store import Repository, default_store_path
from ..store.errors import UnknownRef
from ..store.objects import is_hex_id
from .hibernation import Hibernation
from .remote_tier import RemoteTier, budget_from_env, remote_from_env

EVENT_SCHEMA_ID = "https://events.infinijup.dev/operation"


class SnapshotManager(LoggingConfigurable):
    """Snapshot, restore, branch and history of the server's Infinijup kernels."""

    store_path = Unicode(help="The snapshot store (default: $INFINIJUP_STORE or "
                              "~/.local/share/infinijup/store).").tag(config=True)
    busy_timeout = Float(30.0, help="Seconds a snapshot or restore waits for a busy kernel "
                                    "before answering 409.").tag(config=True)
    answer_timeout = Float(60.0, help="Seconds a restored kernel has to answer.").tag(config=True)
    hot_tier_bytes = Integer(help="Bytes of recent snapshots' images kept ready in the helper's "
                                  "work dir, so that restoring them skips the store checkout "
                                  "(default: a quarter of the memory, at most 32 GiB; 0: none)."
                             ).tag(config=True)

    hibernate_after = Float(0.0, help="Seconds a kernel may stay idle before it is hibernated: "
                                      "snapshotted and its process ended; the next cell wakes "
                                      "it (0: never).").tag(config=True)
    gpu_release_after = Float(0.0, help="Seconds a GPU kernel may stay idle before its GPU "
                                        "memory moves to host memory, freeing the GPU; the next "
                                        "cell brings it back (0: never).").tag(config=True)
    hibernate_on_shutdown = Bool(False, help="Hibernate every idle Infinijup kernel when the "
                                             "server stops (a JupyterHub idle culler, a "
                                             "restart): the next server wakes each on the "
                                             "notebook's next cell. A kernel that is running a "
                                             "cell is not waited for.").tag(config=True)
    make_room_on_wake = Bool(True, help="When a released kernel's GPU memory does not fit back "
                                        "on its GPUs, release the least recently active idle "
                                        "kernels holding memory there first (never a busy "
                                        "one). Off: the wake fails with the reason."
                             ).tag(config=True)
    idle_check_interval = Float(10.0, help="Seconds between two checks for idle kernels."
                                ).tag(config=True)
    remote = Unicode(help="A remote store, s3://bucket/prefix, that every new commit is pushed "
                          "to in the background (default: $INFINIJUP_REMOTE; empty: none). "
                          "Endpoint and credentials as for `infinijup store push`."
                     ).tag(config=True)
    local_budget = Integer(help="Bytes the local store may hold (default: "
                                "$INFINIJUP_LOCAL_BUDGET, e.g. 20G; 0: no limit). Past it, "
                                "commits safely on the remote leave the local store, oldest "
                                "first; restoring one pulls it back.").tag(config=True)
    remote_retry_max = Float(300.0, help="Seconds between retries of a failed background "
                                         "push, at most (the delay doubles from 1 s)."
                             ).tag(config=True)
    remote_shutdown_wait = Float(60.0, help="Seconds a stopping server waits for queued "
                                            "pushes.").tag(config=True)

    @default("store_path")
    def _default_store_path(self) -> str:
        return str(default_store_path())

    @default("hot_tier_bytes")
    def _default_hot_tier_bytes(self) -> int:
        return default_budget()

    @default("remote")
    def _default_remote(self) -> str:
        return remote_from_env()

    @default("local_budget")
    def _default_local_budget(self) -> int:
        return budget_from_env()

    @observe("local_budget")
    def _local_budget_changed(self, _change) -> None:
        if getattr(self, "remote_tier", None) is not None:
            self.remote_tier.budget_changed()

    def __init__(self, serverapp, **kwargs) -> None:
        super().__init__(**kwargs)
        self.serverapp = serverapp
        self._repo: Repository | None = None
        self._heads: dict[str, Head] = {}
        self._launches: dict[str, int] = {}  # kernel id -> provisioner launches at its head
        self._ops: dict[str, dict] = {}
        self._last: dict[str, dict] = {}  # kernel id -> the last finished operation
        self._tasks: set[asyncio.Task] = set()
        self._path_locks: dict[str, asyncio.Lock] = {}  # one resume at a time per notebook
        store = Path(self.store_path)
        self.hibernation = Hibernation(self, store.with_name(store.name + "-hibernated"))
        self.remote_tier = RemoteTier(self)  # background push and eviction (remote_tier.py)
        self.remote_tier.start()

    # --- plumbing ------------------------------------------------------------------------
    @property
    def kernel_manager(self):
        return self.serverapp.kernel_manager

    def repo(self) -> Repository:
        if self._repo is None:
            self._repo = Repository.open_or_init(Path(self.store_path))
        return self._repo

    def engine(self) -> SnapshotEngine:
        return SnapshotEngine(self.repo(), HelperClient(config.helper_socket()),
                              hot_tier_bytes=self.hot_tier_bytes)

    def _kernel(self, kernel_id: str):
        if kernel_id not in self.kernel_manager.list_kernel_ids():
            raise NotFound(f"no kernel {kernel_id}", reason="unknown_kernel")
        return self.kernel_manager.get_kernel(kernel_id)

    # --- what hibernation.py uses -------------------------------------------------------------
    def kernel(self, kernel_id: str):
        return self._kernel(kernel_id)

    def provisioner(self, km) -> InfinijupProvisioner:
        return self._provisioner(km)

    async def wait_idle(self, km) -> None:
        await self._wait_idle(km)

    def kernel_ids(self) -> list[str]:
        return list(self.kernel_manager.list_kernel_ids())

    async def notebook_path(self, kernel_id: str) -> str:
        return await self._path(kernel_id)

    def has_head(self, kernel_id: str) -> bool:
        return self._head(kernel_id).commit is not None

    def event_state(self, kernel_id: str, op: str) -> dict:
        return {"op": op, "op_id": uuid.uuid4().hex, "kernel_id": kernel_id, "path": "",
                "phase": "queued", "percent": 0}

    def event(self, state: dict, phase: str, **extra) -> None:
        self._emit(state, phase, 100 if phase in ("done", "error") else 0, **extra)

    def idle_kernels(self, now: float) -> list[tuple[str, float]]:
        """(kernel id, seconds idle) of the Infinijup kernels that are idle and that no
        operation holds."""
        out = []
        for kernel_id in self.kernel_ids():
            km = self.kernel_manager.get_kernel(kernel_id)
            if not isinstance(getattr(km, "provisioner", None), InfinijupProvisioner):
                continue
            if kernel_id in self._ops or getattr(km, "execution_state", "") != "idle":
                continue
            last = getattr(km, "last_activity", None)
            if last is not None:
                out.append((kernel_id, now - last.timestamp()))
        return out

    def uses_gpu(self, kernel_id: str) -> bool:
        prov = self._provisioner(self._kernel(kernel_id))
        return prov.root_pid is not None and room.uses_cuda(prov.root_pid)

    async def gpu_held(self, kernel_id: str) -> dict[str, int]:
        prov = self._provisioner(self._kernel(kernel_id))
        return await asyncio.to_thread(room.held_by_tree, prov.root_pid)

    async def gpu_free(self) -> dict[str, int]:
        return await asyncio.to_thread(room.free_by_gpu)

    @staticmethod
    def host_memory() -> tuple[int, int]:
        """(available, total) bytes of host memory: where a released kernel's VRAM goes."""
        return room_plan.host_memory()

    async def release_gpu(self, kernel_id: str) -> dict:
        prov = self._provisioner(self._kernel(kernel_id))
        return await asyncio.to_thread(self.engine().release_gpu, prov.root_pid)

    async def reacquire_gpu(self, kernel_id: str) -> dict:
        prov = self._provisioner(self._kernel(kernel_id))
        return await asyncio.to_thread(self.engine().reacquire_gpu, prov.root_pid)

    async def wake_from(self, kernel_id: str, commit: str) -> dict:
        """Bring a hibernated kernel back from its snapshot, in its own session."""
        return await self.restore(kernel_id, commit)

    async def hibernate(self, kernel_id: str, from_kernel: bool = False) -> dict:
        """Hibernate now (409 while a cell runs), or, asked by the kernel itself
        (``%hibernate``), once the asking cell has finished."""
        if not from_kernel:
            return await self.hibernation.hibernate(kernel_id)
        km = self._kernel(kernel_id)
        self._provisioner(km)

        async def run() -> None:
            await asyncio.sleep(0.05)
            try:
                await self._wait_idle(km)
                await self.hibernation.hibernate(kernel_id, reason="%hibernate")
            except InfinijupError as exc:
                self.log.warning("infinijup: %%hibernate of %s failed: %s", kernel_id,
                                 exc.message)

        self._spawn(run())
        return {"kernel_id": kernel_id, "state": "hibernating"}

    async def release(self, kernel_id: str) -> dict:
        self._provisioner(self._kernel(kernel_id))
        return await self.hibernation.release(kernel_id)

    async def wake(self, kernel_id: str) -> dict:
        self._kernel(kernel_id)
        await self.hibernation.wake_soon(kernel_id)
        return {"kernel_id": kernel_id, "state": self.hibernation.state(kernel_id)}

    def kernel_message_key(self, kernel_id: str) -> bytes | None:
        """The message key of a running Infinijup kernel of this server (None otherwise): what
        its own requests are signed with (kernel_auth.py)."""
        if kernel_id not in self.kernel_manager.list_kernel_ids():
            return None
        km = self.kernel_manager.get_kernel(kernel_id)
        if not isinstance(getattr(km, "provisioner", None), InfinijupProvisioner):
            return None
        return bytes(km.session.key) or None

    def _provisioner(self, km) -> InfinijupProvisioner:
        prov = km.provisioner
        if not isinstance(prov, InfinijupProvisioner) or (prov.root_pid is None and
                                                          not prov.hibernated):
            raise PreflightRefused(
                f"kernel {km.kernel_id} does not run under Infinijup: change the notebook's "
                "kernel to 'Python 3 (Infinijup)' to snapshot it",
                reason="kernel_not_managed",
            )
        return prov

    async def _path(self, kernel_id: str) -> str:
        for s in await self.serverapp.session_manager.list_sessions():
            if (s.get("kernel") or {}).get("id") == kernel_id:
                return s.get("path") or s.get("notebook", {}).get("path") or f"kernel-{kernel_id}"
        return f"kernel-{kernel_id}"

    def _head(self, kernel_id: str) -> Head:
        """Where the kernel is. After a restart its state comes from no commit: the next
        snapshot continues its thread's history (the tip becomes its parent)."""
        head = self._heads.get(kernel_id)
        if head is None:
            return Head(commit=None, thread=DEFAULT_THREAD)
        km = self.kernel_manager.get_kernel(kernel_id) if kernel_id in \
            self.kernel_manager.list_kernel_ids() else None
        launches = getattr(getattr(km, "provisioner", None), "launches", None)
        if launches is not None and launches != self._launches.get(kernel_id, launches):
            return Head(commit=None, thread=head.thread or head.base_thread)
        return head

    def _set_head(self, kernel_id: str, head: Head, prov) -> None:
        self._heads[kernel_id] = head
        self._launches[kernel_id] = getattr(prov, "launches", 0)

    async def _begin(self, kernel_id: str, op: str, path: str) -> dict:
        """Start an operation: 409 while another one works on the kernel; after a snapshot
        that only stores its images now (the kernel runs again), it waits its turn."""
        while (running := self._ops.get(kernel_id)) is not None:
            if not running.get("released"):
                raise Conflict(f"a {running['op']} of this kernel is already running "
                               f"(phase {running['phase']})", reason="operation_running")
            await running["finished"].wait()
        state = {"op": op, "op_id": uuid.uuid4().hex, "kernel_id": kernel_id, "path": path,
                 "phase": "queued", "percent": 0, "finished": asyncio.Event()}
        self._ops[kernel_id] = state
        self._emit(state, "queued", 0)
        return state

    def _end(self, state: dict) -> None:
        if self._ops.get(state["kernel_id"]) is state:
            self._ops.pop(state["kernel_id"])
        state["finished"].set()
        self._last[state["kernel_id"]] = {k: state.get(k) for k in
                                          ("op", "op_id", "phase", "commit", "reason")}

    def _emit(self, state: dict, phase: str, percent: float, **extra) -> None:
        state["phase"], state["percent"] = phase, percent
        for key in ("commit", "reason"):
            if extra.get(key):
                state[key] = extra[key]
        data = {k: state[k] for k in ("op", "op_id", "kernel_id", "path")}
        data.update(phase=phase, percent=float(percent))
        data.update({k: str(v) for k, v in extra.items() if v is not None})
        try:
            self.serverapp.event_logger.emit(schema_id=EVENT_SCHEMA_ID, data=data)
        except Exception as exc:  # progress must never break an operation
            self.log.debug("infinijup: event not emitted: %s", exc)

    def _progress(self, state: dict):
        """A thread-safe progress callback for the engine."""
        loop = asyncio.get_running_loop()
        percents = {"dump": 40, "store": 70, "kill": 30, "restore": 60, "gpu": 20}

        def report(phase: str, detail: dict) -> None:
            pct = detail.get("percent", percents.get(phase, state["percent"]))
            loop.call_soon_threadsafe(lambda: self._emit(state, phase, pct,
                                                         message=detail.get("message")))

        return report

    def _connection(self, km) -> dict:
        return saved_connection(km.get_connection_info())

    # --- snapshot ------------------------------------------------------------------------
    async def snapshot(self, kernel_id: str, *, message: str = "", thread: str | None = None,
                       from_kernel: bool = False, execution_count: int | None = None,
                       described: dict | None = None, request_id: str | None = None) -> dict:
        """Quiesce, dump, resume, store: the kernel runs again once it is dumped (resume hooks
        now, not after the ingest; ``%snapshot``'s early answer), and the answer comes once
        the commit is durable."""
        km = self._kernel(kernel_id)
        prov = self._provisioner(km)
        if prov.hibernated:
            raise Conflict("the kernel is hibernated: its last snapshot is its state (run a cell "
                           "to wake it)", reason="kernel_hibernated")
        if thread is not None:
            check_thread_name(thread)
        path = await self._path(kernel_id)
        state = await self._begin(kernel_id, "snapshot", path)
        early: list = []  # the resume (or early answer) started once the kernel was dumped
        try:
            t0 = time.perf_counter()
            if not from_kernel:
                self._emit(state, "quiesce", 10)
                info = await run_agent(km, agent.expression("quiesce"), self.busy_timeout)
                execution_count = info.get("execution_count")
                described = info
            t_quiesce = time.perf_counter() - t0
            loop = asyncio.get_running_loop()

            def on_dumped(dumped, thread_name: str) -> None:  # in the engine's thread
                state["running_again_s"] = time.perf_counter() - t0
                state["released"] = True  # the next operation may queue behind the ingest
                loop.call_soon_threadsafe(lambda: self._emit(
                    state, "store", 60, message="the kernel runs again; storing its images"))
                early.append(asyncio.run_coroutine_threadsafe(
                    self._dumped(state, km, dumped, thread_name, from_kernel, request_id), loop))

            described = agent.commit_metadata(described)
            token = described.get("gpu_segments", {}).get("token")
            said: list = []

            def go() -> None:  # the kernel may take its GPU segments back (gpu_vmm.py)
                if token and not said:
                    said.append(True)
                    gpu_arena.say_go(token)

            def dumped_then(dumped, thread_name: str) -> None:
                go()
                on_dumped(dumped, thread_name)

            try:
                result, plan = await self._dump_and_commit(
                    km, prov, state, path, message, thread, execution_count, described,
                    dumped_then, on_gpu_back=go)
            except Exception:
                await asyncio.to_thread(go)  # no dump, or it failed: the kernel goes on
                await self._settle(early)
                if not from_kernel:  # no commit: the kernel keeps its parent's fingerprints
                    try:
                        await run_agent(km, agent.expression("forget"), self.busy_timeout)
                    except InfinijupError:
                        pass
                    if not early:
                        await self._resume(km, restored=False)
                raise
            await self._settle(early)
            if not from_kernel and not early:
                await self._resume(km, restored=False)
            commit = result.commit
            self.remote_tier.committed(store_thread(notebook_key(path), plan.thread))
            self._set_head(kernel_id, Head(commit=commit.id, thread=plan.thread,
                                           base_thread=plan.thread), prov)
            self._emit(state, "done", 100, commit=commit.id, thread=plan.thread)
            stats = {"image_bytes": result.image_bytes, "stored_bytes": result.stored_bytes,
                     "pause_s": result.pause_s, "quiesce_s": t_quiesce,
                     "running_again_s": state.get("running_again_s"),
                     "store_s": result.phases.get("store_s"), "hot": result.hot,
                     "duration_s": time.perf_counter() - t0}
            for key in ("gpu_release", "gpu_segments"):
                if described.get(key):
                    stats[key] = described[key]
            return {"commit": commit.id, "thread": plan.thread, "parents": list(commit.parents),
                    "stats": stats}
        except InfinijupError as exc:
            self._emit(state, "error", 100, message=exc.message, reason=exc.reason)
            raise
        finally:
            self._end(state)

    async def _dumped(self, state, km, dumped, thread_name, from_kernel, request_id) -> None:
        """The kernel is dumped and runs again: let it go on while the store takes the
        images in."""
        if from_kernel:
            if request_id is not None:  # %snapshot returns now (unless it waits: -w)
                self._write_result(request_id, {
                    "dumped": True, "thread": thread_name,
                    "stats": {"image_bytes": dumped.image_bytes, "pause_s": dumped.pause_s}},
                    suffix=".dumped")
        else:
            await self._resume(km, restored=False, committed=False)

    @staticmethod
    async def _settle(early: list) -> None:
        for fut in early:
            try:
                await asyncio.wrap_future(fut)
            except Exception:  # logged where it failed; the snapshot goes on
                pass

    async def _dump_and_commit(self, km, prov, state, path, message, thread, execution_count,
                               described=None, on_dumped=None, on_gpu_back=None):
        """``on_gpu_back`` is called (in the engine's thread) as soon as the helper has given
        the kernel its GPUs back after CRIU's dump, before it checks and publishes the images:
        the kernel may map its GPU segments back then."""
        repo = self.repo()
        progress = self._progress(state)

        def on_progress(phase: str, detail: dict) -> None:
            if on_gpu_back is not None and phase == "cuda_resume" and \
                    detail.get("state") == "done":
                on_gpu_back()
            progress(phase, detail)

        key = notebook_key(path)
        planned = {"head": self._head(km.kernel_id), "thread": thread}
        connection = self._connection(km)

        def plan_now() -> dict:  # in a worker thread
            plan = plan_snapshot(planned["head"], notebook_threads(repo.threads(), key),
                                 planned["thread"])
            planned["plan"] = plan
            metadata = {
                "notebook_path": path, "notebook_key": key, "thread": plan.thread,
                "kernel_id": km.kernel_id, "kernel_name": km.kernel_name,
                "execution_count": execution_count, "connection": connection,
                "infinijup_version": __version__, "gpu": None, **(described or {}),
            }
            return {"thread": store_thread(key, plan.thread), "metadata": metadata,
                    "parents": list(plan.parents), "expected_tip": plan.expected_tip}

        def replan(_conflict) -> dict:
            """The thread moved meanwhile (someone else snapshotted onto it): the same images
            go to a new thread."""
            old = planned["plan"]
            planned["head"] = Head(commit=planned["head"].commit, thread=None,
                                   base_thread=old.thread)
            planned["thread"] = None
            return plan_now()

        target = await asyncio.to_thread(plan_now)
        extra = {}
        moved = (described or {}).get("gpu_segments", {})
        if moved.get("bytes") or moved.get("segment_bytes"):
            arena = gpu_arena.segments_path(km.kernel_id)
            if arena is None:
                raise SnapshotFailed("snapshot failed: the kernel moved its GPU segments, but "
                                     "this server has no GPU arena", reason="gpu_arena")
            extra[gpu_arena.IMAGE_NAME] = arena
        self._emit(state, "dump", 30)
        result = await asyncio.to_thread(
            self.engine().snapshot, prov.root_pid, message=message,
            on_progress=on_progress, replan=replan, extra_files=extra,
            on_dumped=(lambda d: on_dumped(d, planned["plan"].thread)) if on_dumped else None,
            **target)
        return result, planned["plan"]

    async def _resume(self, km, restored: bool, committed: bool = True,
                      segments: str | None = None) -> None:
        try:
            await run_agent(km, agent.expression("resume", restored, committed, segments),
                            self.busy_timeout)
        except InfinijupError as exc:
            self.log.warning("infinijup: resume hooks of %s: %s", km.kernel_id, exc.message)

    async def snapshot_for_kernel(self, kernel_id, message, thread, request_id,
                                  execution_count, described=None) -> dict:
        """A snapshot the kernel asked for (``%snapshot``): it waits on a result file."""
        self._kernel(kernel_id)

        async def run() -> None:
            try:
                out = await self.snapshot(kernel_id, message=message, thread=thread,
                                          from_kernel=True, execution_count=execution_count,
                                          described=described, request_id=request_id)
            except InfinijupError as exc:
                out = {"error": {"message": exc.message, "reason": exc.reason}}
            except Exception as exc:  # the kernel is waiting: it must hear back
                self.log.exception("infinijup: snapshot for kernel failed")
                out = {"error": {"message": str(exc), "reason": "internal_error"}}
            self._write_result(request_id, out)

        self._spawn(run())
        return {"request_id": request_id}

    def _write_result(self, request_id: str, out: dict, suffix: str = "") -> None:
        directory = Path(os.environ.get(config.RESULTS_DIR_ENV) or config.results_dir())
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = directory / f".{request_id}{suffix}.tmp"
        tmp.write_text(json.dumps(out))
        os.chmod(tmp, 0o600)
        os.replace(tmp, directory / f"{request_id}{suffix}.json")

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- restore -------------------------------------------------------------------------
    def _resolve(self, key: str, ref: str) -> str:
        repo = self.repo()
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

    async def restore(self, kernel_id: str, ref: str, *, branch: str | None = None,
                      wait_idle: bool = False, force: bool = False,
                      gpu_map: dict[str, str] | None = None) -> dict:
        km = self._kernel(kernel_id)
        prov = self._provisioner(km)
        path = await self._path(kernel_id)
        key = notebook_key(path)
        repo = self.repo()
        if branch is not None:
            check_thread_name(branch)
        commit_id = await asyncio.to_thread(self._resolve, key, ref)
        commit = await asyncio.to_thread(repo.get_commit, commit_id)
        threads = notebook_threads(await asyncio.to_thread(repo.threads), key)
        if branch is not None and branch in threads:
            raise Conflict(f"thread '{branch}' already exists", reason="thread_exists")
        retarget = plan_retarget((commit.metadata or {}).get("connection") or {},
                                 self._connection(km))
        gpu_pairs = await asyncio.to_thread(plan_gpu_restore, commit.metadata or {},
                                            force=force, requested=gpu_map)
        state = await self._begin(kernel_id, "restore", path)
        session_key = km.session.key
        t0 = time.perf_counter()
        segments: str | None = None
        token = None
        self.hibernation.restore_begins(kernel_id)
        try:
            if wait_idle:
                await self._wait_idle(km)
            self._emit(state, "store", 10)
            engine = self.engine()
            source: dict = {}
            images = await self.remote_tier.images(state, engine, commit_id, source)
            segments = gpu_arena.set_aside(images)  # engine.restore removes the images
            token = ((commit.metadata or {}).get("gpu_segments") or {}).get("token")
            if segments is not None and token:
                gpu_arena.say_go(token, segments)  # the restored kernel takes this copy
            info = km.get_connection_info()
            await asyncio.to_thread(endpoints.check, info["ip"])
            paths = endpoint_paths(info)
            connected = connections_to([paths[k] for k in ("shell_port", "iopub_port",
                                                           "stdin_port", "control_port")])
            prov.restoring = True
            if retarget.saved_key is not None:  # it signs with its own key until adopted
                km.session.key = retarget.saved_key
            try:
                result = await asyncio.to_thread(
                    engine.restore, images, prov.root_pid, self._progress(state), gpu_pairs,
                    retarget.path_map, None if retarget.same_session else prov.log_path)
                pid, phases = result.pid, {**result.phases, "checkout_s": source["checkout_s"],
                                           "images": source["source"],
                                           **({"pulled": source["pulled"]}
                                              if "pulled" in source else {})}
            except RestoreFailed as exc:
                pid = await self._find_orphan(km, prov, exc)
                if pid is None:
                    km.session.key = session_key
                    if not prov.hibernated:  # a hibernated kernel stays so, to wake later
                        await self._recover(km, prov, exc)
                    raise
                phases = {"adopted": True}
            prov.attach(pid)
            self._emit(state, "reconnect", 85)
            reconnect_s = await wait_reconnected(connected, self.answer_timeout)
            try:
                answer_s = await wait_answering(km, self.answer_timeout)
            except RestoreFailed as exc:
                if not phases.get("adopted"):
                    raise
                await prov.kill()
                km.session.key = session_key
                await self._recover(km, prov, exc)
                raise
            if not retarget.same_session:
                adopt = adopt_expression(kernel_id, self.serverapp.connection_url,
                                         str(config.results_dir()), km.connection_file or None,
                                         info["ip"], rekey=retarget.saved_key is not None)
                adopted = await run_agent(km, adopt, self.busy_timeout, then_key=session_key)
                km.session.key = session_key  # the kernel signs with it from now on
                if retarget.saved_key is not None:
                    watch_activity_anew(self.kernel_manager, km)
                if "error" in adopted:
                    raise RestoreFailed("the restored kernel could not take this session's "
                                        f"endpoints and key: {adopted['error']}")
            await self._resume(km, restored=True, segments=segments)
            self.hibernation.restored(kernel_id)  # a hibernated kernel restored: awake
            commit_thread = (commit.metadata or {}).get("thread", DEFAULT_THREAD)
            if branch is not None:
                await asyncio.to_thread(repo.set_thread, store_thread(key, branch), commit_id,
                                        expected=None)
                threads[branch] = commit_id
            head = head_after_restore(commit_id, commit_thread, threads, branch)
            self._set_head(kernel_id, head, prov)
            self._emit(state, "done", 100, commit=commit_id, thread=head.thread or "")
            return {"kernel_id": kernel_id, "commit": commit_id, "thread": head.thread,
                    "duration_s": time.perf_counter() - t0,
                    "phases": {**phases, "reconnect_s": reconnect_s, "answer_s": answer_s}}
        except InfinijupError as exc:
            self._emit(state, "error", 100, message=exc.message, reason=exc.reason)
            raise
        finally:
            km.session.key = session_key  # the session's key, whatever happened
            prov.restoring = False
            if segments is not None:
                gpu_arena.discard(segments)
                if token:
                    gpu_arena.forget_go(token)
            self.hibernation.restore_ends(kernel_id)
            self._end(state)

    async def _wait_idle(self, km) -> None:
        deadline = time.monotonic() + self.busy_timeout
        while getattr(km, "execution_state", "idle") not in ("idle", "dead"):
            if time.monotonic() > deadline:
                raise Conflict(f"the kernel stayed busy for {self.busy_timeout:.0f} s",
                               reason="kernel_busy")
            await asyncio.sleep(0.05)

    async def _find_orphan(self, km, prov, exc: RestoreFailed) -> int | None:
        """After the helper died mid-restore: the tree CRIU went on to restore, if any.

        The old kernel is gone by then (the helper kills it before CRIU starts). Adopting the
        restored tree finishes the restore the user asked for; leaving it would leave an
        untracked kernel holding this kernel's ports, so that no fresh kernel could start.
        """
        if not getattr(exc, "tree_may_exist", False):
            return None
        if prov.tracked is not None and prov.tracked.alive():
            return None
        shell = endpoint_paths(km.get_connection_info())["shell_port"]
        pid = await asyncio.to_thread(find_restored_tree, shell)
        if pid is not None:
            self.log.warning("infinijup: the helper died during the restore of kernel %s; "
                             "adopting the tree it restored (pid %d)", km.kernel_id, pid)
        return pid

    async def _recover(self, km, prov, exc: RestoreFailed) -> None:
        """After a failed restore: keep the old kernel if it lives, else start a fresh one."""
        prov.restoring = False
        if prov.tracked is not None and prov.tracked.alive():
            return
        self.log.warning("infinijup: restore failed (%s); restarting kernel %s fresh",
                         exc.message, km.kernel_id)
        try:
            await self.kernel_manager.restart_kernel(km.kernel_id)
            self._heads.pop(km.kernel_id, None)
            exc.args = (f"{exc.message} (the kernel was restarted fresh; every snapshot is "
                        "intact)",)
        except Exception as restart_exc:
            exc.args = (f"{exc.message}; restarting the kernel failed too: {restart_exc}",)
            # Say so in the kernel's model (GET /api/kernels): it is dead until restarted.
            km.execution_state = "dead"
            km.reason = exc.message

    async def restore_for_kernel(self, kernel_id: str, ref: str, branch: str | None) -> dict:
        """A restore the kernel asked for (``%restore``): starts once its cell has finished."""
        km = self._kernel(kernel_id)
        self._provisioner(km)
        path = await self._path(kernel_id)
        commit_id = await asyncio.to_thread(self._resolve, notebook_key(path), ref)
        # What restore() would refuse, refused now: the %restore cell fails, not the next one.
        if branch is not None:
            check_thread_name(branch)
            threads = notebook_threads(await asyncio.to_thread(self.repo().threads),
                                       notebook_key(path))
            if branch in threads:
                raise Conflict(f"thread '{branch}' already exists", reason="thread_exists")
        meta = (await asyncio.to_thread(self.repo().get_commit, commit_id)).metadata or {}
        plan_retarget(meta.get("connection") or {}, self._connection(km))
        await asyncio.to_thread(plan_gpu_restore, meta)

        async def run() -> None:
            await asyncio.sleep(0.05)
            try:
                await self.restore(kernel_id, commit_id, branch=branch, wait_idle=True)
            except InfinijupError as exc:
                self.log.warning("infinijup: restore asked by kernel failed: %s", exc.message)

        self._spawn(run())
        return {"kernel_id": kernel_id, "commit": commit_id}

    # --- resume: a snapshot into a new (or the notebook's running) kernel --------------------
    async def resume(self, path: str, ref: str, *, kernel_name: str | None = None,
                     new_notebook: bool = False, force: bool = False) -> dict:
        """Bring commit ``ref`` back in notebook ``path``: into its running kernel if it has
        one, else into a new kernel started for it. ``new_notebook`` first copies the notebook
        (``<name>-<commit>.ipynb``) and resumes there, beside whatever runs in the original.

        Everything that can refuse (unknown commit, other GPUs, a snapshot without a saved
        key) refuses before a kernel is started; a resume that fails later leaves no kernel
        it started behind.
        """
        repo = self.repo()
        commit_id = await asyncio.to_thread(self._resolve, notebook_key(path), ref)
        commit = await asyncio.to_thread(repo.get_commit, commit_id)
        meta = commit.metadata or {}
        await asyncio.to_thread(plan_gpu_restore, meta, force=force)
        why_not = why_not_retargetable(meta.get("connection") or {}, self._session_connection())
        if why_not is not None:
            raise PreflightRefused(why_not, reason="not_resumable_here")
        if new_notebook:
            path = await self._copy_notebook(path, commit_id)
        t0 = time.perf_counter()
        async with self._path_lock(path):
            sessions = self.serverapp.session_manager
            session = await self._session_of(path)
            started = session is None
            if started:
                session = await sessions.create_session(
                    path=path, name=path, type="notebook",
                    kernel_name=kernel_name or meta.get("kernel_name") or "infinijup")
            kernel_id = session["kernel"]["id"]
            try:
                result = await self.restore(kernel_id, commit_id, force=force)
            except BaseException:
                if started:
                    await sessions.delete_session(session["id"])
                    self._heads.pop(kernel_id, None)
                raise
        return {**result, "session_id": session["id"], "path": path, "started": started,
                "duration_s": time.perf_counter() - t0}

    async def _session_of(self, path: str) -> dict | None:
        for s in await self.serverapp.session_manager.list_sessions():
            if s.get("path") == path and (s.get("kernel") or {}).get("id") in \
                    self.kernel_manager.list_kernel_ids():
                return s
        return None

    def _path_lock(self, path: str) -> asyncio.Lock:
        return self._path_locks.setdefault(path, asyncio.Lock())

    async def _copy_notebook(self, path: str, commit_id: str) -> str:
        """A new notebook beside ``path`` for a resumed kernel (an empty one if ``path`` is
        gone), named after the commit; returns its path."""
        from jupyter_server.utils import ensure_async

        cm = self.serverapp.contents_manager
        directory, _, name = path.rpartition("/")
        stem = name[:-6] if name.endswith(".ipynb") else name
        for n in range(1, 1000):
            suffix = commit_id[:8] if n == 1 else f"{commit_id[:8]}-{n}"
            new_path = f"{directory}/{stem}-{suffix}.ipynb".lstrip("/")
            if not await ensure_async(cm.exists(new_path)):
                break
        else:
            raise Conflict(f"too many copies of {path}", reason="notebook_exists")
        if await ensure_async(cm.exists(path)):
            model = await ensure_async(cm.get(path, content=True, type="notebook"))
            model = {"type": "notebook", "format": "json", "content": model["content"]}
        else:
            import nbformat

            model = {"type": "notebook", "format": "json", "content": nbformat.v4.new_notebook()}
        await ensure_async(cm.save(model, new_path))
        return new_path

    # --- branch, history, status -----------------------------------------------------------
    async def branch(self, kernel_id: str, name: str) -> dict:
        self._kernel(kernel_id)
        check_thread_name(name)
        path = await self._path(kernel_id)
        key = notebook_key(path)
        threads = notebook_threads(await asyncio.to_thread(self.repo().threads), key)
        if name in threads:
            raise Conflict(f"thread '{name}' already exists", reason="thread_exists")
        head = self._head(kernel_id)
        if head.commit is not None:
            await asyncio.to_thread(self.repo().set_thread, store_thread(key, name),
                                    head.commit, expected=None)
        self._set_head(kernel_id, Head(commit=head.commit, thread=name, base_thread=name),
                       self._kernel(kernel_id).provisioner)
        return {"kernel_id": kernel_id, "thread": name, "commit": head.commit}

    async def history(self, kernel_id: str | None = None, path: str | None = None) -> dict:
        if kernel_id is None and path is None:
            raise BadRequest("give kernel_id or path")
        if kernel_id is not None:
            self._kernel(kernel_id)
            path = await self._path(kernel_id)
            running = self._ops.get(kernel_id)
            if running is not None and running.get("released"):
                # a snapshot the kernel has gone on from is being stored: it is part of the
                # kernel's history, so the answer waits for it (read your own snapshots)
                await running["finished"].wait()
        return await asyncio.to_thread(self._history, path, kernel_id)

    def _history(self, path: str, kernel_id: str | None) -> dict:
        repo = self.repo()
        key = notebook_key(path)
        threads = notebook_threads(repo.threads(), key)
        commits: dict[str, object] = {}
        for name in threads:
            for c in repo.log(store_thread(key, name)):
                commits.setdefault(c.id, c)
        ordered = sorted(commits.values(), key=lambda c: c.created, reverse=True)
        head = self._head(kernel_id) if kernel_id else Head(commit=None, thread=DEFAULT_THREAD)
        # Where the next snapshot goes, planned as a snapshot would plan it (the UI shows it).
        next_thread = plan_snapshot(head, threads, None).thread
        elsewhere = self.remote_tier.remote_only()
        return {
            "path": path,
            "commits": [{**self._commit_json(c, self._resumable(c)),
                         "remote_only": c.id in elsewhere} for c in ordered],
            "threads": threads,
            "head": {"thread": head.thread, "commit": head.commit, "next_thread": next_thread},
        }

    @staticmethod
    def _session_connection() -> dict:
        """What a new Infinijup kernel of this server is sure to have: its transport (its key
        and endpoints are its own, and a restore moves the snapshot's to them)."""
        return {"transport": "ipc"}

    def _resumable(self, c) -> str | None:
        """Why commit ``c`` cannot be resumed into a new kernel here (None: it can)."""
        meta = c.metadata or {}
        why_not = why_not_retargetable(meta.get("connection") or {}, self._session_connection())
        if why_not is not None:
            return why_not
        try:
            plan_gpu_restore(meta)
        except InfinijupError as exc:
            return exc.message
        return None

    @staticmethod
    def _commit_json(c, not_resumable: str | None = None) -> dict:
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

    async def status(self, kernel_id: str | None) -> dict:
        if not kernel_id:
            raise BadRequest("give kernel_id")
        km = self._kernel(kernel_id)
        managed = isinstance(km.provisioner, InfinijupProvisioner)
        op = self._ops.get(kernel_id)
        return {"kernel_id": kernel_id, "managed": managed,
                "state": self.hibernation.state(kernel_id),
                "operation": {k: op[k] for k in ("op", "phase", "percent")} if op else None,
                "last_operation": self._last.get(kernel_id),
                "head": {"thread": self._head(kernel_id).thread,
                         "commit": self._head(kernel_id).commit},
                "remote": self.remote_tier.status(self._head(kernel_id).commit)}
