"""The helper as a child subreaper: reap the tree roots it launched or restored.

Kernel tree roots become the helper's children twice over: spawned roots are reparented to it
when the launcher exits (PR_SET_CHILD_SUBREAPER), restored roots are created as its children
(CRIU's ``rst_sibling``). Each must be reaped, or a later restore of the same image fails with
"File exists" and ``status`` could never report an exit.

Roots are the registry's trees (registry.py), watched through their pidfds and reaped through
them (``waitid(P_PIDFD)``) — never ``wait(-1)``, which would steal the exit status of processes
that ``subprocess`` waits for itself (CRIU's swrk, the launcher). A tree an op holds is not
reaped until the op is done, so its pid cannot be reused under the op. A slow sweep reaps
anything else that ends up a zombie child of the helper and stays one for a whole sweep
interval, which nobody else is then going to wait for.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from .registry import Registry, Tree

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
SWEEP_INTERVAL_S = 5.0


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


class Reaper:
    """One thread: polls the registry's pidfds, reaps tree roots that exited."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = False
        self.on_ended: Callable[[Tree], None] | None = None  # a tree it reaped (ops.tree_ended)
        self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)
        registry.wake = self._wake

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    # --- the reaping thread -----------------------------------------------------------------

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        suspects: set[int] = set()
        while not self._stop:
            for pid in self.registry.released():
                self._reap(pid)
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            by_fd = self.registry.watched()
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            timeout_ms = max(0, int((next_sweep - time.monotonic()) * 1000))
            try:
                events = poller.poll(timeout_ms)
            except InterruptedError:
                continue
            for fd, _mask in events:
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif fd in by_fd:
                    self._reap(by_fd[fd])
            if time.monotonic() >= next_sweep:
                suspects = self._sweep(suspects)
                next_sweep = time.monotonic() + SWEEP_INTERVAL_S

    def _reap(self, pid: int) -> None:
        try:
            tree = self.registry.lookup(pid)
            self.registry.exited(pid)
            if tree is not None and self.on_ended is not None and \
                    self.registry.lookup(pid) is not tree:
                self.on_ended(tree)
        except Exception:  # noqa: BLE001 - the reaper must outlive any one error
            log.exception("reaping %d failed", pid)

    def _sweep(self, suspects: set[int]) -> set[int]:
        """Reap untracked zombie children seen in two consecutive sweeps."""
        me = os.getpid()
        zombies = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == b"Z" and int(fields[1]) == me:
                zombies.add(int(name))
        zombies -= {t.pid for t in self.registry.owned_by(None)}
        for pid in zombies & suspects:
            if self.registry.lookup(pid) is not None:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
                log.info("reaped stray child %d", pid)
            except ChildProcessError:
                pass
        return zombies - suspects
