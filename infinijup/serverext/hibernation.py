"""Idle kernels give back what they hold, and wake on the next request (issue 14).

Two ways to rest:
- **released**: the kernel's VRAM moves to host memory in place (the helper's GPU release, no
  CRIU); the process keeps running and the GPU is free for others.
- **hibernated**: the kernel is snapshotted to the store and its process ended: no process, no
  RAM, no VRAM. The kernel stays in the server (same id, same endpoints, same websocket), and a
  record beside the store names its snapshot, so a later server can bring it back too.

While a kernel rests, the websocket layer (``websocket.py``) holds every request the notebook
sends; the first one that is not a ``kernel_info_request`` wakes the kernel (``wake``), and the
held requests then go to it in the order they came. A wake that fails answers each held request
with the reason; the kernel stays resting, and resumable from its snapshot.

Snapshot and restore are ``snapshot_flow.py`` and ``restore_flow.py``; the kernel's state
(released, hibernating, ...) and its allowed moves are the lifecycle's (engine/lifecycle.py);
this module decides when to rest, keeps what a resting kernel needs (``Rest``) and the records.
Idle times come from jupyter_server's ``last_activity`` of each kernel.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.heads import Head
from ..engine.lifecycle import (
    HIBERNATED,
    HIBERNATING,
    RELEASED,
    RELEASING,
    RUNNING,
    WAKING,
    Operation,
)
from ..engine.naming import DEFAULT_THREAD
from ..engine.steps import Steps
from ..errors import Conflict, HelperError, InfinijupError, NotFound
from ..gpu.room_plan import Candidate, margin_for, plan_room, release_refusal
from . import kernel_records
from .restore_flow import restore
from .snapshot_flow import snapshot

# How long a release cut short by the helper's death waits for it to come back (to unlock the
# kernel's CUDA), and the reasons that mean it is away rather than refusing
HELPER_BACK_S = 60.0
HELPER_AWAY = ("helper_unavailable", "helper_disconnected")


@dataclass
class Rest:
    """What a resting kernel (or one on its way into or out of rest) needs; its state is the
    lifecycle's."""

    commit: str | None = None  # the snapshot a hibernated kernel wakes from
    # a hibernation of a kernel unchanged since its head: that snapshot is kept aside (on
    # ``aside_ref(kernel id)``, no commit of the history) and the kernel wakes onto this head
    head: Head | None = None
    since: float = field(default_factory=time.time)
    wake: asyncio.Future | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)  # into rest, or gave up
    vram: dict[str, int] = field(default_factory=dict)  # a released kernel's bytes, by GPU
    token: str | None = None  # a released kernel's segments in its arena wait for this word


class Hibernation:
    def __init__(self, manager, records_dir: Path) -> None:
        self.manager = manager
        self.lifecycle = manager.lifecycle
        self.records = records_dir
        self.rests: dict[str, Rest] = {}
        self.stopping = False  # the server is shutting its kernels down: keep their records
        self.listeners: dict[str, set] = {}  # kernel id -> websocket connections holding requests
        self.came_back: set[str] = set()  # restored from rest, not yet running (notify)
        # kernel id -> what it last answered to requests that need no computation
        # (websocket.resting_answer): a resting kernel answers them from here, asleep
        self.known: dict[str, dict[str, dict]] = {}
        self._ticker: asyncio.Task | None = None
        # one decision about GPU room at a time: two wakes (or allocations) racing for the same
        # room must not both count the same free bytes or the same idle kernel
        self._room = asyncio.Lock()

    # --- what the websocket layer asks ------------------------------------------------------
    def holds(self, kernel_id: str) -> bool:
        """Requests to this kernel wait (it rests, or is going to or coming out of rest, or a
        restore replaces its process: a cell must not run before its GPU memory is back)."""
        return self.lifecycle.holds(kernel_id)

    async def claim_record(self, kernel_id: str) -> None:
        """A kernel's websocket opens: if its notebook was hibernated by an earlier server and
        this kernel is new (nothing snapshotted or restored in it yet), it stands in for that
        kernel: its first request wakes it from the record's snapshot."""
        if self.lifecycle.state(kernel_id) != RUNNING or not self.records.is_dir():
            return
        try:
            path = await self.manager.notebook_path(kernel_id)
        except InfinijupError:
            return
        if self.manager.has_head(kernel_id):
            return
        for record in self._records():
            if record.get("path") == path and record.get("kernel_id") != kernel_id and \
                    record.get("kernel_id") not in self.manager.kernel_ids():
                self.lifecycle.stand_in_hibernated(kernel_id)
                self.rests[kernel_id] = Rest(commit=record["commit"],
                                             since=record.get("since", time.time()),
                                             head=_record_head(record))
                self._move_record(record["kernel_id"], kernel_id, record)
                self.manager.log.info("infinijup: kernel %s stands in for %s, hibernated at %s",
                                      kernel_id, record["kernel_id"], record["commit"][:12])
                return

    def wake_soon(self, kernel_id: str) -> asyncio.Future:
        """Wake the kernel (once, however many ask); the future is done when it answers."""
        rest = self.rests.get(kernel_id)
        state = self.lifecycle.state(kernel_id)
        if rest is None or not self.lifecycle.resting(kernel_id):
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if state in (HIBERNATING, RELEASING):  # wake it once it is in (or has given up)
            return asyncio.ensure_future(self._wake_after(kernel_id, rest))
        if rest.wake is None:
            rest.wake = asyncio.ensure_future(self._wake(kernel_id, rest))
        return rest.wake

    async def _wake_after(self, kernel_id: str, rest: Rest) -> None:
        await rest.entered.wait()
        await self.wake_soon(kernel_id)

    def notify(self, kernel_id: str, error: str | None = None) -> None:
        """Tell the connections holding requests for this kernel: send them on (it runs), or
        answer them with ``error`` (it could not wake)."""
        came_back = kernel_id in self.came_back and error is None
        self.came_back.discard(kernel_id)
        for conn in list(self.listeners.get(kernel_id, ())):
            conn.held_done(error, came_back=came_back)

    # --- resting ---------------------------------------------------------------------------
    async def hibernate(self, kernel_id: str, *, reason: str = "asked") -> dict:
        """Snapshot the kernel to the store, then end its process. Refused (409) while it
        runs a cell: a hibernation never interrupts one."""
        m = self.manager
        km = m.kernel(kernel_id)
        prov = m.provisioner(km)
        state = self.lifecycle.state(kernel_id)
        if state == HIBERNATED:
            return {"kernel_id": kernel_id, "state": HIBERNATED,
                    "commit": self.rests[kernel_id].commit}
        if self.lifecycle.resting(kernel_id) and state != RELEASED:
            raise Conflict(f"the kernel is {state}", reason="kernel_" + state)
        await m.wait_idle(km)  # 409 after busy_timeout: never interrupts a cell
        if state == RELEASED:  # its GPU memory comes back first, then the snapshot
            await self.wake_soon(kernel_id)
        # requests from notebooks are held from now on (websocket.py): nothing runs between
        # the snapshot and the end of the process
        turn = await self.lifecycle.begin(kernel_id, HIBERNATING)
        self.rests[kernel_id] = rest = Rest()
        event = Operation("hibernate", kernel_id)
        m.events.end(event, "queued", kernel_state=HIBERNATING)
        try:
            head = m.heads.get(kernel_id)
            snap = await snapshot(m, kernel_id, message=f"hibernated ({reason})", within=turn,
                                  aside=aside_ref(kernel_id))
            rest.head = head if snap.get("aside") else None
            prov.hibernated = True
            prov.on_discard = lambda: self._discard(kernel_id)
            await prov.end_process()
            rest.commit, rest.since = snap["commit"], time.time()
            turn.to(HIBERNATED)
            self._write_record(kernel_id, {"kernel_id": kernel_id,
                                           "path": await m.notebook_path(kernel_id),
                                           "commit": snap["commit"], "since": rest.since,
                                           **_head_record(rest.head)})
        except BaseException as exc:
            self.rests.pop(kernel_id, None)
            prov.hibernated = False
            rest.entered.set()
            if turn.state == HIBERNATING:
                turn.back()  # running: the requests held meanwhile go to it
            m.events.failed(event, exc, kernel_state=RUNNING)
            raise
        rest.entered.set()
        m.events.end(event, "done", kernel_state=HIBERNATED, commit=snap["commit"])
        return {"kernel_id": kernel_id, "state": HIBERNATED, "commit": snap["commit"],
                "recorded": rest.head is None}

    async def release(self, kernel_id: str) -> dict:
        """Move the kernel's VRAM to host memory; the process runs on without its GPUs."""
        m = self.manager
        km = m.kernel(kernel_id)
        if self.lifecycle.resting(kernel_id):
            return {"kernel_id": kernel_id, "state": self.lifecycle.shown(kernel_id)}
        await m.wait_idle(km)
        turn = await self.lifecycle.begin(kernel_id, RELEASING)
        self.rests[kernel_id] = rest = Rest()
        event = Operation("release", kernel_id)
        # its process now (another one after: it died, and was restarted)
        root = getattr(getattr(km, "provisioner", None), "root_pid", None)
        try:
            rest.vram = await m.gpu_held(kernel_id)
            # its GPU memory goes to host memory: only if that holds it (room_plan.py)
            available, total = m.host_memory()
            why = release_refusal(rest.vram, await self._label(kernel_id), available,
                                  margin_for(total))
            if why is not None:
                raise Conflict(why, reason="no_host_memory")
            detail = await self._release_steps(kernel_id, rest)
        except BaseException as exc:
            prov = getattr(km, "provisioner", None)
            if isinstance(exc, Exception) and hasattr(prov, "has_live_process") and (
                    prov.root_pid != root or not prov.has_live_process()):
                # the driver's own words ("CUDA unlock failed: NOT_INITIALIZED") hide the cause
                exc = InfinijupError(f"the kernel's process ended during its GPU release "
                                     f"({getattr(exc, 'message', exc)}); Jupyter restarts it "
                                     "fresh", reason="kernel_died")
            self.rests.pop(kernel_id, None)
            rest.entered.set()
            turn.back()  # running: the requests held meanwhile go to it
            m.events.failed(event, exc, kernel_state=RUNNING)
            raise exc
        turn.to(RELEASED)
        rest.entered.set()
        rest.since = time.time()
        m.events.end(event, "done", kernel_state=RELEASED)
        return {"kernel_id": kernel_id, "state": RELEASED, "gpu": detail}

    async def _release_steps(self, kernel_id: str, rest: Rest) -> dict:
        """PyTorch's segments into the kernel's arena file at copy-engine speed, then the
        driver's checkpoint of what is left; a failure brings the segments back."""
        m = self.manager
        async with Steps(m.log) as step:
            moved = await step("offload", m.offload_gpu(kernel_id),
                               undo=lambda: m.bring_back_gpu(kernel_id, rest.token))
            rest.token = moved.get("token")
            # cut short (the helper killed between the driver's lock and its answer), the
            # driver's step leaves the kernel's CUDA locked or checkpointed: it is taken back
            # (unlocked) before the segments are mapped again, else the kernel would hang
            await step("driver-undo", undo=lambda: self._take_gpu_back(kernel_id))
            detail = await step("driver", m.release_gpu(kernel_id))
        return {**detail, "arena": {k: moved[k] for k in ("bytes", "seconds", "fallback")
                                    if k in moved}}

    async def _take_gpu_back(self, kernel_id: str) -> None:
        """Resume whatever of the kernel's CUDA is locked or checkpointed (nothing: a no-op).
        A helper that died meanwhile is waited for a while (a service manager restarts it)."""
        deadline = time.monotonic() + HELPER_BACK_S
        while True:
            try:
                await self.manager.reacquire_gpu(kernel_id)
                return
            except HelperError as exc:
                if exc.reason not in HELPER_AWAY or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _wake(self, kernel_id: str, rest: Rest) -> None:
        m = self.manager
        before = self.lifecycle.state(kernel_id)
        turn = await self.lifecycle.begin(kernel_id, WAKING)
        event = Operation("wake", kernel_id)
        m.events.end(event, "queued", kernel_state=WAKING)
        t0 = time.perf_counter()
        try:
            if before == RELEASED:
                async with self._room:  # the room made is taken before anyone else decides
                    await self._make_room(kernel_id, rest.vram)
                    await m.reacquire_gpu(kernel_id)
                back = await m.bring_back_gpu(kernel_id, rest.token)
                if any(str(e).startswith("GPU segments") for e in back.get("hook_errors", ())):
                    m.log.warning("infinijup: kernel %s woke, but its GPU segments did not "
                                  "come back yet (its next cell tries again): %s", kernel_id,
                                  back["hook_errors"])
            else:  # from its snapshot, in its own session
                woke = await restore(m, kernel_id, rest.commit, within=turn)
                # where a wake's time went (the wake bench reads it from the log)
                m.log.info("infinijup: kernel %s woke from %s: %s", kernel_id, rest.commit,
                           json.dumps({"duration_s": woke.get("duration_s"),
                                       "phases": woke.get("phases")}, default=str))
                if rest.head is not None:  # it stands where it stood before it slept
                    m.heads.set(kernel_id, rest.head, m.kernel(kernel_id).provisioner)
        except BaseException as exc:
            rest.wake = None
            if turn.state == WAKING:
                turn.to(before)  # still resting, still resumable
            message = getattr(exc, "message", str(exc))
            self.notify(kernel_id, error=f"the kernel could not wake: {message} (it is still "
                                         f"{before}; run the cell again to retry)")
            m.events.failed(event, exc, kernel_state=before)
            raise
        self.restored(kernel_id)
        turn.to(RUNNING)  # the requests held meanwhile go on now
        m.events.end(event, "done", kernel_state=RUNNING, commit=rest.commit,
                     message=f"awake in {time.perf_counter() - t0:.2f} s")

    async def _make_room(self, kernel_id: str, need: dict[str, int]) -> None:
        """Before a released kernel takes its GPU memory back: release the least recently
        active idle kernels that hold memory on the GPUs short of it, until it fits; never a
        busy kernel. One whose memory host memory cannot keep is hibernated instead where
        host memory can hold it on its way to the store (``make_room_hibernate``), else passed
        over (room_plan.py). If the room cannot be made so, nothing moves and the wake is
        refused with the reason."""
        if need and self.manager.make_room_on_wake:
            await self.make_room(kernel_id, need)

    async def make_room_for_allocation(self, kernel_id: str, need: dict[str, int]) -> None:
        """A running kernel's allocation found no room (``/infinijup/make-room``): as for a
        wake, one decision at a time (the kernel then allocates the room made itself)."""
        async with self._room:
            await self.make_room(kernel_id, need)

    async def make_room(self, kernel_id: str, need: dict[str, int]) -> None:
        """Room for ``need`` (bytes by GPU) for ``kernel_id``, as above (a wake's, or a running
        kernel's allocation that found none)."""
        free = await self.manager.gpu_free()
        if all(n <= free.get(g, 0) for g, n in need.items()):
            return
        idle = sorted(self.manager.idle_kernels(time.time()), key=lambda k: -k[1])
        candidates = [Candidate(other, await self._label(other),
                                await self.manager.gpu_held(other))
                      for other, _idle_s in idle
                      if other != kernel_id and not self.lifecycle.resting(other)]
        available, total = self.manager.host_memory()
        plan = plan_room(need, free, candidates, available, margin_for(total),
                         can_hibernate=getattr(self.manager, "make_room_hibernate", False))
        if plan.refusal is not None:
            raise Conflict(plan.refusal, reason="no_room")
        for other in plan.hibernate:  # first: each passes through host memory and leaves it
            self.manager.log.info("infinijup: hibernating idle kernel %s to make room for %s "
                                  "(host memory cannot keep its GPU memory)", other, kernel_id)
            await self.hibernate(other, reason=f"room for {await self._label(kernel_id)}")
        for other in plan.release:
            self.manager.log.info("infinijup: releasing idle kernel %s to make room for %s",
                                  other, kernel_id)
            await self.release(other)

    async def _label(self, kernel_id: str) -> str:
        try:
            return await self.manager.notebook_path(kernel_id) or kernel_id
        except InfinijupError:
            return kernel_id

    def restored(self, kernel_id: str) -> None:
        """A restore gave the kernel a process again and it answers (a wake, or a restore the
        user asked for): it rests no more (the lifecycle's move to running lets the requests
        held for it go on)."""
        rest = self.rests.pop(kernel_id, None)
        if rest is not None:
            self.came_back.add(kernel_id)  # (notify: its websockets subscribe to it anew)
            self._remove_record(kernel_id)
            if rest.head is not None:  # it slept in a snapshot kept aside
                self._drop_aside(kernel_id)

    def _discard(self, kernel_id: str) -> None:
        """A hibernated kernel was shut down (or restarted): by its user, its record goes;
        by a server that is stopping, it stays for the next server."""
        rest = self.rests.pop(kernel_id, None)
        self.came_back.discard(kernel_id)
        self.lifecycle.forget(kernel_id)
        if not self.stopping:
            self._remove_record(kernel_id)
            if rest is not None and rest.head is not None:
                self._drop_aside(kernel_id)
        self.notify(kernel_id, error="the kernel was shut down while it was hibernated")

    async def hibernate_all(self) -> None:
        """The server stops: hibernate each idle kernel (a busy one is not waited for)."""
        for kernel_id, _idle_s in self.manager.idle_kernels(time.time()):
            try:
                await self.hibernate(kernel_id, reason="server stopping")
            except Exception as exc:
                self.manager.log.warning("infinijup: kernel %s not hibernated at shutdown: %s",
                                         kernel_id, getattr(exc, "message", exc))

    # --- idle policy -------------------------------------------------------------------------
    def start(self, interval: float) -> None:
        """Check for idle kernels every ``interval`` s, once the server's loop runs (only when
        an idle policy is on)."""
        from tornado.ioloop import IOLoop

        def begin() -> None:
            if self._ticker is None:
                self._ticker = asyncio.ensure_future(self._tick_forever(interval))

        if interval > 0 and (self.manager.hibernate_after > 0 or
                             self.manager.gpu_release_after > 0):
            IOLoop.current().add_callback(begin)

    async def _tick_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.tick(time.time())
            except Exception as exc:  # the policy must never take the server down
                self.manager.log.warning("infinijup: idle check failed: %s", exc)

    async def tick(self, now: float) -> None:
        """Rest the kernels idle long enough; never a busy one, never one an operation holds."""
        release_after = self.manager.gpu_release_after
        hibernate_after = self.manager.hibernate_after
        quiet_s = min((t for t in (release_after, hibernate_after) if t > 0), default=None)
        if quiet_s is not None:
            await self.manager.recheck_quiet(now, quiet_s)
        for kernel_id, idle_s in self.manager.idle_kernels(now):
            state = self.lifecycle.state(kernel_id)  # running or released (idle_kernels)
            try:
                if hibernate_after > 0 and idle_s >= hibernate_after:
                    await self.hibernate(kernel_id, reason=f"idle {idle_s:.0f} s")
                elif release_after > 0 and idle_s >= release_after and state == RUNNING and \
                        self.manager.uses_gpu(kernel_id):
                    await self.release(kernel_id)
            except InfinijupError as exc:
                self.manager.log.info("infinijup: kernel %s not rested: %s", kernel_id,
                                      exc.message)

    # --- records: which kernel sleeps in which snapshot (they outlive the server) -------------
    def _drop_aside(self, kernel_id: str) -> None:
        """The snapshot a kernel slept in aside is not needed any more (it woke, or was shut
        down): its ref goes, and gc may take what only it held."""
        try:
            self.manager.repo().delete_thread(aside_ref(kernel_id))
        except NotFound:  # gone already
            pass
        except InfinijupError as exc:
            self.manager.log.warning("infinijup: could not drop %s: %s", aside_ref(kernel_id),
                                     exc.message)

    def _write_record(self, kernel_id: str, record: dict) -> None:
        kernel_records.write(self.records, kernel_id, record)

    def _move_record(self, old: str, new: str, record: dict) -> None:
        self._write_record(new, {**record, "kernel_id": new})
        self._remove_record(old)

    def _remove_record(self, kernel_id: str) -> None:
        kernel_records.remove(self.records, kernel_id)

    def _records(self) -> list[dict]:
        return kernel_records.read_all(self.records,
                                       lambda r: bool(r.get("commit") and r.get("path")))


def aside_ref(kernel_id: str) -> str:
    """The store ref that keeps a hibernated kernel's snapshot when it is no commit of the
    notebook's history (the kernel was unchanged since its head)."""
    return f"hibernated--{kernel_id}"


def _head_record(head: Head | None) -> dict:
    if head is None:
        return {}
    return {"head": {"commit": head.commit, "thread": head.thread,
                     "base_thread": head.base_thread}}


def _record_head(record: dict) -> Head | None:
    h = record.get("head")
    if not isinstance(h, dict) or not isinstance(h.get("commit"), str):
        return None
    thread = h.get("thread") if isinstance(h.get("thread"), str) else None
    base = h.get("base_thread") if isinstance(h.get("base_thread"), str) else DEFAULT_THREAD
    return Head(commit=h["commit"], thread=thread, base_thread=base)
