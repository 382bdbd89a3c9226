"""The snapshot manager: Jupyter's kernels on one side, Infinijup's operations on the other.

What the web layer (handlers.py, websocket.py) calls, and what the operations share:

- ``lifecycle`` (engine/lifecycle.py): each kernel's state and its allowed moves; one
  operation at a time per kernel (a second gets 409, or waits while a snapshot stores).
- ``events`` (events.py): each phase on jupyter_server's event bus.
- ``heads`` (history.py): where each kernel is in its notebook's history.
- the operations, each in its own module: ``snapshot_flow``, ``restore_flow``, ``resume``,
  ``hibernation`` (release, hibernate, wake, the idle policy), ``history`` (branch, history),
  ``remote_tier`` (background push).

Blocking work (helper calls, store I/O) runs in threads so the server keeps serving while a
kernel is dumped. docs/architecture.md draws the path of a snapshot and of a restore.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from traitlets import observe

from .. import config
from ..engine import SnapshotEngine
from ..engine.extra_files import StoredVersions
from ..engine.kernel_channel import answers_between_cells, run_agent, watch_activity_anew
from ..engine.lifecycle import HIBERNATED, RELEASED, RUNNING, Lifecycle
from ..errors import BadRequest, Conflict, InfinijupError, NotFound, PreflightRefused
from ..gpu import arena as gpu_arena
from ..gpu import room, room_plan
from ..helper_client import HelperClient
from ..kernel_magics import agent
from ..provisioner import InfinijupProvisioner
from ..store import Repository
from . import history, kernel_status, restore_flow, snapshot_flow
from .events import EVENT_SCHEMA_ID, Events
from .hibernation import Hibernation
from .remote_tier import RemoteTier
from .resume import Resumes
from .retention import Retention
from .settings import ManagerSettings
from .undo import UndoRedo

__all__ = ["EVENT_SCHEMA_ID", "SnapshotManager"]

# The server's view of a kernel's state comes from the iopub statuses it saw, and misses those
# sent before its subscription reached the kernel: past this many seconds of "busy" (or
# "starting"), a wait asks the kernel itself (kernel_channel.answers_between_cells).
ASK_KERNEL_AFTER = 0.5
RECHECK_WAIT = 2.0  # how long the idle policy waits for a quiet kernel's answer


class SnapshotManager(ManagerSettings):
    """Snapshot, restore, branch and history of the server's Infinijup kernels (its settings:
    settings.py)."""

    @observe("local_budget")
    def _local_budget_changed(self, _change) -> None:
        if getattr(self, "remote_tier", None) is not None:
            self.remote_tier.budget_changed()

    def __init__(self, serverapp, **kwargs) -> None:
        super().__init__(**kwargs)
        self.serverapp = serverapp
        self._repo: Repository | None = None
        self._repo_lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._helper_features: dict | None = None  # what the helper says it can do (asked once)
        # kernel id -> the kernel a restore replaced, or an undo set aside (aside.py)
        self.kept_aside: dict = {}
        self._busy_waits: dict[str, set[asyncio.Event]] = {}  # kernel id -> waits to cancel
        self._rechecked: dict[str, float] = {}  # kernel id -> when recheck_quiet last asked it
        self.lifecycle = Lifecycle(on_move=self._moved)
        self.events = Events(serverapp, self.log)
        self.heads = history.Heads(serverapp.kernel_manager)
        store = Path(self.store_path)
        self.hibernation = Hibernation(self, store.with_name(store.name + "-hibernated"))
        self.resumes = Resumes(self)
        self.undo_redo = UndoRedo(self)  # undo.py
        self.retention = Retention(self)  # retention.py: automatic snapshots in a window
        self.remote_tier = RemoteTier(self)  # background push and eviction (remote_tier.py)
        self.stored_versions = StoredVersions()  # the arena files' last blobs (extra_files.py)
        self.remote_tier.start()

    # --- what the web layer calls -------------------------------------------------------------
    async def snapshot(self, kernel_id: str, **kwargs) -> dict:
        return await snapshot_flow.snapshot(self, kernel_id, **kwargs)

    async def snapshot_for_kernel(self, kernel_id, message, thread, request_id,
                                  execution_count, described=None) -> dict:
        return await snapshot_flow.snapshot_for_kernel(self, kernel_id, message, thread,
                                                       request_id, execution_count, described)

    async def restore(self, kernel_id: str, ref: str, **kwargs) -> dict:
        """A restore asked for over REST waits for a running cell as a snapshot does (409 past
        ``busy_timeout``): it never ends a cell the user is running (interrupt it first). A
        resting kernel has no cell to wait for."""
        km = self.kernel(kernel_id)
        if self.lifecycle.resting(kernel_id):
            return await restore_flow.restore(self, kernel_id, ref, **kwargs)
        await self.wait_idle(km)
        return await self.restore_keeping_settings(kernel_id, ref, **kwargs)

    async def restore_keeping_settings(self, kernel_id: str, ref: str, **kwargs) -> dict:
        """A restore after which the kernel's automatic snapshots are as they were before it
        (the restored process had those of its snapshot's moment). A hibernated kernel is not
        asked (it has no process to answer): it takes the snapshot's."""
        before = None
        if self.lifecycle.state(kernel_id) != HIBERNATED:
            try:
                before = (await self.kernel_autosnapshot(kernel_id, None)).get("on")
            except InfinijupError:
                pass
        result = await restore_flow.restore(self, kernel_id, ref, **kwargs)
        if isinstance(before, bool):
            try:
                await self.kernel_autosnapshot(kernel_id, before)
            except InfinijupError as exc:
                self.log.warning("infinijup: automatic snapshots of %s not set back after the "
                                 "restore: %s", kernel_id, exc.message)
        return result

    async def restore_for_kernel(self, kernel_id: str, ref: str, branch: str | None) -> dict:
        return await restore_flow.restore_for_kernel(self, kernel_id, ref, branch)

    async def resume(self, path: str, ref: str, **kwargs) -> dict:
        return await self.resumes.resume(path, ref, **kwargs)

    async def kernel_autosnapshot(self, kernel_id: str, on: bool | None) -> dict:
        """A kernel's automatic snapshots (kernel_magics/autosnap.py): on, off, or as they are."""
        km = self.kernel(kernel_id)
        self.provisioner(km)
        out = await run_agent(km, agent.expression("autosnapshot", on), self.busy_timeout)
        return {"kernel_id": kernel_id, **out}

    async def branch(self, kernel_id: str, name: str) -> dict:
        return await history.branch(self, kernel_id, name)

    async def history(self, kernel_id: str | None = None, path: str | None = None) -> dict:
        if kernel_id is None and path is None:
            raise BadRequest("give kernel_id or path")
        if kernel_id is not None:
            self.kernel(kernel_id)
            path = await self.notebook_path(kernel_id)
            # a snapshot the kernel has gone on from is being stored: it is part of the
            # kernel's history, so the answer waits for it (read your own snapshots)
            await self.lifecycle.stored(kernel_id)
        head = self.heads.get(kernel_id)
        return await asyncio.to_thread(lambda: history.history(
            self.repo(), path, head, self.remote_tier.remote_only()))

    async def hibernate(self, kernel_id: str, from_kernel: bool = False) -> dict:
        """Hibernate now (409 while a cell runs), or, asked by the kernel itself
        (``%hibernate``), once the asking cell has finished."""
        if not from_kernel:
            return await self.hibernation.hibernate(kernel_id)
        km = self.kernel(kernel_id)
        self.provisioner(km)

        async def run() -> None:
            await asyncio.sleep(0.05)
            try:
                await self.wait_idle(km)
                await self.hibernation.hibernate(kernel_id, reason="%hibernate")
            except InfinijupError as exc:
                self.log.warning("infinijup: %%hibernate of %s failed: %s", kernel_id,
                                 exc.message)

        self.spawn(run())
        return {"kernel_id": kernel_id, "state": "hibernating"}

    async def release(self, kernel_id: str) -> dict:
        self.provisioner(self.kernel(kernel_id))
        return await self.hibernation.release(kernel_id)

    async def make_room(self, kernel_id: str, nbytes: int, gpu: str) -> dict:
        """A running kernel's allocation of ``nbytes`` found no room on ``gpu`` (its UUID, with
        or without NVML's "GPU-"): idle kernels there give way (hibernation.make_room), or
        409 with the reason."""
        self.provisioner(self.kernel(kernel_id))
        if not self.make_room_for_running:
            raise Conflict("making room for a running kernel is off "
                           "(SnapshotManager.make_room_for_running)", reason="make_room_off")
        try:
            free = await self.gpu_free()
        except Exception as exc:  # no NVML, no GPU
            raise Conflict(f"cannot read the GPUs' memory here: {exc}", reason="no_gpu") from None
        match = [g for g in free if g in (gpu, f"GPU-{gpu}")] or (list(free) if len(free) == 1
                                                                  else [])
        if not match:
            raise BadRequest(f"no GPU {gpu!r} here", reason="unknown_gpu")
        await self.hibernation.make_room_for_allocation(kernel_id, {match[0]: int(nbytes)})
        return {"kernel_id": kernel_id, "gpu": match[0], "bytes": int(nbytes)}

    async def wake(self, kernel_id: str) -> dict:
        self.kernel(kernel_id)
        await self.hibernation.wake_soon(kernel_id)
        return {"kernel_id": kernel_id, "state": self.lifecycle.shown(kernel_id)}

    async def status(self, kernel_id: str | None) -> dict:
        return await kernel_status.status(self, kernel_id)

    def kernel_message_key(self, kernel_id: str) -> bytes | None:
        """The message key of a running Infinijup kernel of this server (None otherwise): what
        its own requests are signed with (kernel_auth.py)."""
        if kernel_id not in self.kernel_manager.list_kernel_ids():
            return None
        km = self.kernel_manager.get_kernel(kernel_id)
        if not isinstance(getattr(km, "provisioner", None), InfinijupProvisioner):
            return None
        return bytes(km.session.key) or None

    # --- what the operations share ----------------------------------------------------------
    @property
    def kernel_manager(self):
        return self.serverapp.kernel_manager

    def repo(self) -> Repository:
        """The store, opened once (flows call this from worker threads too: one opener)."""
        with self._repo_lock:
            if self._repo is None:
                self._repo = Repository.open_or_init(Path(self.store_path))
            return self._repo

    def engine(self) -> SnapshotEngine:
        return SnapshotEngine(self.repo(), HelperClient(config.helper_socket()),
                              hot_tier_bytes=self.hot_tier_bytes,
                              lazy_restore=self.lazy_restore,
                              pages_from_store_min_bytes=self.pages_from_store_min_bytes,
                              ingest_nice=self.autosnapshot_ingest_nice,
                              stored_versions=self.stored_versions)

    def helper_has(self, feature: str) -> bool:
        """Whether the helper does ``feature`` (its hello's features, asked once per server);
        False while it cannot be asked."""
        if self._helper_features is None:
            try:
                self._helper_features = dict(self.engine().helper.hello().features)
            except InfinijupError:
                return False
        return bool(self._helper_features.get(feature))

    def kernel(self, kernel_id: str):
        if kernel_id not in self.kernel_manager.list_kernel_ids():
            raise NotFound(f"no kernel {kernel_id}", reason="unknown_kernel")
        return self.kernel_manager.get_kernel(kernel_id)

    def kernel_ids(self) -> list[str]:
        return list(self.kernel_manager.list_kernel_ids())

    def provisioner(self, km) -> InfinijupProvisioner:
        """The kernel's Infinijup provisioner (409 for a kernel that does not run under one).
        Its restarter guard asks the lifecycle whether the kernel's process is away on
        purpose (hibernated, or replaced by a restore)."""
        prov = km.provisioner
        if not isinstance(prov, InfinijupProvisioner) or (prov.root_pid is None and
                                                          not prov.hibernated):
            raise PreflightRefused(
                f"kernel {km.kernel_id} does not run under Infinijup: change the notebook's "
                "kernel to 'Python 3 (Infinijup)' to snapshot it",
                reason="kernel_not_managed",
            )
        if prov.away_on_purpose is None:
            kernel_id = km.kernel_id
            prov.away_on_purpose = lambda: self.lifecycle.no_process_on_purpose(kernel_id)
        return prov

    async def notebook_path(self, kernel_id: str) -> str:
        for s in await self.serverapp.session_manager.list_sessions():
            if (s.get("kernel") or {}).get("id") == kernel_id:
                return s.get("path") or s.get("notebook", {}).get("path") or f"kernel-{kernel_id}"
        # a kernel resumed for a notebook whose client makes the session (resume.py)
        return self.resumes.paths.get(kernel_id) or f"kernel-{kernel_id}"

    def has_head(self, kernel_id: str) -> bool:
        return self.heads.get(kernel_id).commit is not None

    async def wait_idle(self, km) -> None:
        """Until the kernel's running cell ends: 409 ``kernel_busy`` past ``busy_timeout``,
        409 ``cancelled`` on ``cancel``; never interrupts the cell."""
        started = time.monotonic()
        deadline = started + self.busy_timeout
        stop = asyncio.Event()
        waits = self._busy_waits.setdefault(km.kernel_id, set())
        waits.add(stop)
        asked = seen = None  # the kernel itself, asked once the view has said busy a while
        try:
            while getattr(km, "execution_state", "idle") not in ("idle", "dead"):
                if asked is None and time.monotonic() - started > ASK_KERNEL_AFTER \
                        and self.lifecycle.state(km.kernel_id) in (RUNNING, RELEASED):
                    seen = getattr(km, "last_activity", None)
                    asked = asyncio.ensure_future(
                        answers_between_cells(km, deadline - time.monotonic()))
                if asked is not None and self._answered_idle(km, asked, seen):
                    return
                if stop.is_set():
                    raise Conflict("cancelled while the kernel was busy: the running cell "
                                   "goes on", reason="cancelled")
                if time.monotonic() > deadline:
                    raise Conflict(f"the kernel stayed busy for {self.busy_timeout:.0f} s: wait "
                                   "for the running cell to finish (or interrupt it) and try "
                                   "again", reason="kernel_busy")
                await asyncio.sleep(0.05)
        finally:
            waits.discard(stop)
            if asked is not None:
                asked.cancel()

    async def recheck_quiet(self, now: float, quiet_s: float) -> None:
        """Ask each kernel that the server's view has shown busy (or starting), with no message
        read for ``quiet_s``, whether it is between cells (at most once per ``quiet_s``): the
        idle policy then rests a kernel whose idle the view missed, never a busy one."""
        ids = self.kernel_ids()
        self._rechecked = {k: t for k, t in self._rechecked.items() if k in ids}
        for kernel_id in ids:
            km = self.kernel_manager.get_kernel(kernel_id)
            last = getattr(km, "last_activity", None)
            if not isinstance(getattr(km, "provisioner", None), InfinijupProvisioner) \
                    or getattr(km, "execution_state", "idle") in ("idle", "dead") \
                    or self.lifecycle.busy(kernel_id) \
                    or last is None or now - last.timestamp() < quiet_s \
                    or now - self._rechecked.get(kernel_id, float("-inf")) < quiet_s:
                continue
            self._rechecked[kernel_id] = now
            asked = asyncio.ensure_future(answers_between_cells(km, RECHECK_WAIT))
            await asyncio.wait([asked])
            self._answered_idle(km, asked, last)

    def _answered_idle(self, km, asked: asyncio.Future, seen) -> bool:  # noqa: ANN001
        """The kernel answered between cells, and the server's view, which said otherwise,
        read no message while it was asked (its ``last_activity`` is still ``seen``): the view
        is set right and watched anew (jupyter_server's reader of the kernel's statuses reads
        nothing more after a message it cannot verify). A view that read messages meanwhile is
        live, and left to say when the kernel is idle."""
        if not asked.done() or asked.cancelled() or asked.exception() is not None \
                or not asked.result() or getattr(km, "last_activity", None) != seen:
            return False
        self.log.warning("infinijup: kernel %s answered between cells while the server's view "
                         "said %r: it is idle", km.kernel_id, km.execution_state)
        watch_activity_anew(self.kernel_manager, km)
        km.execution_state = "idle"
        return True

    async def cancel(self, kernel_id: str) -> dict:
        """Give up what waits for this busy kernel (a snapshot, restore, hibernation or
        release not yet begun): each answers 409 ``cancelled``; the running cell goes on.
        What has begun (a dump, a restore) is not stopped."""
        self.kernel(kernel_id)
        n = 0
        for stop in list(self._busy_waits.get(kernel_id, ())):
            stop.set()
            n += 1
        op = self.lifecycle.operation(kernel_id)
        if op is not None and op.phase in ("queued", "quiesce") and not op.cancel.is_set():
            op.cancel.set()
            n += 1
        return {"kernel_id": kernel_id, "cancelled": n}

    async def resume_hooks(self, km, restored: bool, committed: bool = True,
                           segments: str | None = None) -> None:
        """The kernel's own resume hooks (agent.py): after a dump, or in a restored kernel."""
        try:
            await run_agent(km, agent.expression("resume", restored, committed, segments),
                            self.busy_timeout)
        except InfinijupError as exc:
            self.log.warning("infinijup: resume hooks of %s: %s", km.kernel_id, exc.message)

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _moved(self, kernel_id: str, _old: str, new: str) -> None:
        if new == RUNNING:  # requests held while it rested or was restored go on now
            self.hibernation.notify(kernel_id)

    # --- what hibernation.py asks of kernels and GPUs ----------------------------------------
    def idle_kernels(self, now: float) -> list[tuple[str, float]]:
        """(kernel id, seconds idle) of the Infinijup kernels that are idle, running or
        released, with no operation under way."""
        out = []
        for kernel_id in self.kernel_ids():
            km = self.kernel_manager.get_kernel(kernel_id)
            if not isinstance(getattr(km, "provisioner", None), InfinijupProvisioner):
                continue
            if self.lifecycle.busy(kernel_id) or getattr(km, "execution_state", "") != "idle":
                continue
            last = getattr(km, "last_activity", None)
            if last is not None:
                out.append((kernel_id, now - last.timestamp()))
        return out

    def uses_gpu(self, kernel_id: str) -> bool:
        prov = self.provisioner(self.kernel(kernel_id))
        return prov.root_pid is not None and room.uses_cuda(prov.root_pid)

    async def gpu_held(self, kernel_id: str) -> dict[str, int]:
        prov = self.provisioner(self.kernel(kernel_id))
        return await asyncio.to_thread(room.held_by_tree, prov.root_pid)

    async def gpu_free(self) -> dict[str, int]:
        return await asyncio.to_thread(room.free_by_gpu)

    @staticmethod
    def host_memory() -> tuple[int, int]:
        """(available, total) bytes of host memory: where a released kernel's VRAM goes."""
        return room_plan.host_memory()

    async def release_gpu(self, kernel_id: str) -> dict:
        """The helper's driver checkpoint of what is on the kernel's GPUs (after
        ``offload_gpu``: only what PyTorch's allocator does not cover)."""
        prov = self.provisioner(self.kernel(kernel_id))
        return await asyncio.to_thread(self.engine().release_gpu, prov.root_pid)

    async def offload_gpu(self, kernel_id: str) -> dict:
        """The kernel moves PyTorch's GPU segments into its arena file (host memory) at
        copy-engine speed (gpu_vmm.py); ``{}`` where it has none or takes the driver path
        (``{"fallback": why}``)."""
        if not self.gpu_release_through_arena:
            return {}
        deadline = time.time() + self.busy_timeout

        async def undo(info: dict) -> None:  # a release that ran after we gave up on it
            await self.bring_back_gpu(kernel_id, (info.get("gpu_segments") or {}).get("token"))

        info = await run_agent(self.kernel(kernel_id), agent.expression("release", deadline),
                               self.busy_timeout, late=undo)
        refused = agent.refusal(info)
        if refused is not None:  # the kernel touched nothing (kernel_magics/unsavable.py)
            raise PreflightRefused(refused[0], reason=refused[1])
        return info.get("gpu_segments") or {}

    async def bring_back_gpu(self, kernel_id: str, token: str | None) -> dict:
        """After ``reacquire_gpu`` (or a failed release): the kernel maps its segments back
        from its arena file and runs its resume hooks."""
        if token:
            await asyncio.to_thread(gpu_arena.say_go, token)
        t0 = time.perf_counter()
        try:
            info = await run_agent(self.kernel(kernel_id),
                                   agent.expression("wake"),
                                   self.busy_timeout)
        finally:
            if token:
                await asyncio.to_thread(gpu_arena.forget_go, token)
        return {**info, "seconds": round(time.perf_counter() - t0, 3)}

    async def reacquire_gpu(self, kernel_id: str) -> dict:
        prov = self.provisioner(self.kernel(kernel_id))
        return await asyncio.to_thread(self.engine().reacquire_gpu, prov.root_pid)
