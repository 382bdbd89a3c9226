"""Where each kernel is in its life, and the moves it may make: the one place that says so.

    running ──► snapshotting ──► storing ──► running     (a snapshot: the kernel runs again
       │                                                   once dumped, while the store works)
       ├──► restoring ──► running                         (a restore; a failed one of a
       │         │                                         hibernated kernel leaves it so)
       │         ├──► storing ──► running                 (an undo: the kernel it left is
       │         │                                         dumped and stored behind it)
       │         └──► settling ──► running                (a restore in place from the store:
       │                                                   the kernel it replaced is kept aside
       │                                                   until the memory is all back)
       ├──► releasing ──► released ──► waking ──► running (its GPU memory in host memory)
       └──► hibernating ──► hibernated ──► waking ──► running  (snapshotted, no process)

A failed move goes back where it came from (``Turn.back``). Snapshot, restore, hibernation,
release and wake each take a ``Turn``; the websocket layer asks ``holds`` (requests wait), the
idle policy asks ``busy``, the provisioner's restarter guard asks ``no_process_on_purpose``,
and ``/infinijup/status`` reports ``state`` and the operation under way.

Operations (snapshot, restore) also carry a record for progress events (``Operation``); an
operation asked for while a snapshot stores its images waits for the store, then goes on; any
other move from a state that does not allow it is refused with 409 and the state. Settling is
waited for in the same way.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from ..errors import Conflict

RUNNING = "running"
SNAPSHOTTING = "snapshotting"
STORING = "storing"  # the kernel runs again; its snapshot's images are being stored
RESTORING = "restoring"
SETTLING = "settling"  # the kernel runs; the kernel it replaced is kept until its memory is back
RELEASING = "releasing"
RELEASED = "released"
HIBERNATING = "hibernating"
HIBERNATED = "hibernated"
WAKING = "waking"

MOVES: dict[str, frozenset[str]] = {
    RUNNING: frozenset({SNAPSHOTTING, RESTORING, RELEASING, HIBERNATING}),
    SNAPSHOTTING: frozenset({STORING, RUNNING}),
    STORING: frozenset({RUNNING}),
    SETTLING: frozenset({RUNNING}),
    RESTORING: frozenset({RUNNING, RELEASED, HIBERNATED, STORING, SETTLING}),
    RELEASING: frozenset({RELEASED, RUNNING}),
    RELEASED: frozenset({WAKING, RESTORING}),
    HIBERNATING: frozenset({HIBERNATED, RUNNING}),
    HIBERNATED: frozenset({WAKING, RESTORING}),
    WAKING: frozenset({RUNNING, RELEASED, HIBERNATED}),
}

# A kernel in these states gives back what it holds; the notebook's requests wait for it
RESTING = frozenset({RELEASING, RELEASED, HIBERNATING, HIBERNATED, WAKING})
# What a notebook sees (GET /infinijup/status ``state``, the Lab's rest states): a kernel that
# snapshots, stores or is restored is running; one on its way into release is released.
SHOWN = {SNAPSHOTTING: RUNNING, STORING: RUNNING, SETTLING: RUNNING, RESTORING: RUNNING,
         RELEASING: RELEASED}


@dataclass
class Operation:
    """A snapshot or restore under way, as its progress events tell it."""

    op: str
    kernel_id: str
    path: str = ""
    op_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    phase: str = "queued"
    percent: float = 0
    commit: str | None = None
    reason: str | None = None
    # part of a larger move the user asked for (an undo), or an automatic snapshot: its events
    # say so, and Lab shows no notification of its own for it
    quiet: bool = False
    # set to give up waiting for a busy kernel (POST /infinijup/cancel); nothing else stops
    cancel: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)

    def summary(self) -> dict:
        return {"op": self.op, "op_id": self.op_id, "phase": self.phase, "commit": self.commit,
                "reason": self.reason}


@dataclass
class _Kernel:
    state: str = RUNNING
    operation: Operation | None = None
    last: dict | None = None  # the last finished operation's summary
    moved: asyncio.Event = field(default_factory=asyncio.Event)  # set at every move


class Turn:
    """One kernel's move under way: ``to`` moves it on, ``back`` returns it to where the turn
    began (after a failure), ``done`` ends the turn in a state of the caller's choosing."""

    def __init__(self, lifecycle: Lifecycle, kernel_id: str, began: str) -> None:
        self.lifecycle, self.kernel_id, self.began = lifecycle, kernel_id, began

    @property
    def state(self) -> str:
        return self.lifecycle.state(self.kernel_id)

    def to(self, state: str) -> None:
        self.lifecycle.move(self.kernel_id, state)

    def back(self) -> None:
        """After a failure: where the turn began (a kernel that was running runs)."""
        if self.state != self.began:
            self.to(self.began)


class Lifecycle:
    """The lifecycle state of every kernel of one server (kernels not listed are running)."""

    def __init__(self, on_move=None) -> None:  # noqa: ANN001 - (kernel id, old, new) -> None
        self._kernels: dict[str, _Kernel] = {}
        self._on_move = on_move

    def _k(self, kernel_id: str) -> _Kernel:
        return self._kernels.setdefault(kernel_id, _Kernel())

    # --- questions ---------------------------------------------------------------------------
    def state(self, kernel_id: str) -> str:
        k = self._kernels.get(kernel_id)
        return k.state if k else RUNNING

    def shown(self, kernel_id: str) -> str:
        state = self.state(kernel_id)
        return SHOWN.get(state, state)

    def resting(self, kernel_id: str) -> bool:
        return self.state(kernel_id) in RESTING

    def holds(self, kernel_id: str) -> bool:
        """Requests from notebooks wait: it rests (or is on its way into or out of rest), or a
        restore replaces its process (a cell must not run before its memory is back)."""
        return self.state(kernel_id) in RESTING | {RESTORING}

    def busy(self, kernel_id: str) -> bool:
        """Something is under way or pending for it (the idle policy leaves it be): any state
        but running or released, or an operation."""
        return self.state(kernel_id) not in (RUNNING, RELEASED) or \
            self.operation(kernel_id) is not None

    def no_process_on_purpose(self, kernel_id: str) -> bool:
        """Its process is gone or replaced on purpose: jupyter_client's restarter must not
        start a fresh kernel beside it. (Settling: a restored tree that ends before its memory
        is back gives way to the kernel it replaced, serverext/settle.py.)"""
        return self.state(kernel_id) in (HIBERNATED, RESTORING, WAKING, SETTLING)

    def operation(self, kernel_id: str) -> Operation | None:
        k = self._kernels.get(kernel_id)
        return k.operation if k else None

    def last(self, kernel_id: str) -> dict | None:
        k = self._kernels.get(kernel_id)
        return k.last if k else None

    # --- moves -------------------------------------------------------------------------------
    def move(self, kernel_id: str, state: str) -> None:
        k = self._k(kernel_id)
        if state not in MOVES[k.state]:
            raise Conflict(f"the kernel is {k.state}: it cannot go {state} now",
                           reason=f"kernel_{k.state}")
        self._set(kernel_id, k, state)

    def _set(self, kernel_id: str, k: _Kernel, state: str) -> None:
        old, k.state = k.state, state
        k.moved.set()
        k.moved = asyncio.Event()
        if self._on_move is not None:
            self._on_move(kernel_id, old, state)

    def stand_in_hibernated(self, kernel_id: str) -> None:
        """A new kernel stands in for one an earlier server hibernated: its state is that
        kernel's snapshot, and its first request wakes it from there (hibernation.py). Only a
        kernel that runs with nothing under way may."""
        k = self._k(kernel_id)
        if k.state != RUNNING or k.operation is not None:
            raise Conflict(f"the kernel is {k.state}", reason=f"kernel_{k.state}")
        self._set(kernel_id, k, HIBERNATED)  # a move MOVES does not allow any other way

    async def begin(self, kernel_id: str, state: str) -> Turn:
        """Start a move. A kernel whose snapshot is being stored (or that is settling) finishes
        that first; a kernel in the middle of another operation refuses (409)."""
        await self.settled(kernel_id)
        k = self._k(kernel_id)
        if state not in MOVES[k.state]:
            if k.operation is not None:
                raise Conflict(f"a {k.operation.op} of this kernel is already running "
                               f"(phase {k.operation.phase})", reason="operation_running")
        turn = Turn(self, kernel_id, k.state)
        self.move(kernel_id, state)
        return turn

    async def stored(self, kernel_id: str) -> None:
        """Wait while a snapshot the kernel has gone on from is being stored."""
        await self._while(kernel_id, STORING)

    async def settled(self, kernel_id: str) -> None:
        """Wait while the kernel finishes what it has gone on from: a snapshot being stored, or
        the kernel a restore replaced, kept until the restored memory is back."""
        await self._while(kernel_id, STORING, SETTLING)

    async def _while(self, kernel_id: str, *states: str) -> None:
        while self.state(kernel_id) in states:
            await self._kernels[kernel_id].moved.wait()

    # --- the operation record ------------------------------------------------------------------
    def start_operation(self, op: Operation) -> None:
        self._k(op.kernel_id).operation = op

    def end_operation(self, op: Operation) -> None:
        k = self._k(op.kernel_id)
        if k.operation is op:
            k.operation = None
        k.last = op.summary()

    def forget(self, kernel_id: str) -> None:
        """The kernel is gone from the server."""
        self._kernels.pop(kernel_id, None)
