"""The helper as a child subreaper: reap the tree roots it launched or restored.

Kernel tree roots become the helper's children twice over: spawned roots are reparented to it
when the launcher exits (PR_SET_CHILD_SUBREAPER), restored roots are created as its children
(CRIU's ``rst_sibling``). Each must be reaped, or a later restore of the same image fails with
"File exists" and ``status`` could never report an exit.

Roots are watched through pidfds and reaped with ``waitpid(pid)`` — never ``wait(-1)``, which
would steal the exit status of processes that ``subprocess`` waits for itself (CRIU's swrk, the
launcher). A slow sweep reaps anything else that ends up a zombie child of the helper and stays
one for a whole sweep interval, which nobody else is then going to wait for.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import select
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
SWEEP_INTERVAL_S = 5.0
KEEP_EXITED = 4096


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@dataclass(frozen=True)
class ExitRecord:
    pid: int
    owner_uid: int
    exit_code: int | None  # negative: killed by that signal (os.waitstatus_to_exitcode)


class Reaper:
    """Tracks tree roots by pid; one thread polls their pidfds and reaps them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watched: dict[int, tuple[int, int]] = {}  # pid -> (pidfd, owner uid)
        self._exited: collections.OrderedDict[int, ExitRecord] = collections.OrderedDict()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)

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

    # --- API used by ops --------------------------------------------------------------------

    def track(self, pid: int, owner_uid: int) -> None:
        """Watch a root that is a child of the helper (a zombie is fine: it is reaped at once)."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._record(pid, owner_uid, None)
            return
        with self._lock:
            self._exited.pop(pid, None)
            old = self._watched.pop(pid, None)
            if old is not None:
                os.close(old[0])
            self._watched[pid] = (pidfd, owner_uid)
        self._wake()

    def is_tracked(self, pid: int) -> bool:
        with self._lock:
            return pid in self._watched

    def exit_record(self, pid: int) -> ExitRecord | None:
        with self._lock:
            return self._exited.get(pid)

    def wait_reaped(self, pid: int, timeout: float) -> ExitRecord | None:
        """Block until a tracked pid has been reaped; ``None`` on timeout or if not tracked."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid in self._watched:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return self._exited.get(pid)

    # --- the reaping thread -----------------------------------------------------------------

    def _record(self, pid: int, owner_uid: int, code: int | None) -> None:
        with self._lock:
            self._exited[pid] = ExitRecord(pid, owner_uid, code)
            self._exited.move_to_end(pid)
            while len(self._exited) > KEEP_EXITED:
                self._exited.popitem(last=False)
            self._changed.notify_all()

    def _reap(self, pid: int) -> None:
        with self._lock:
            entry = self._watched.get(pid)
        if entry is None:
            return
        pidfd, owner = entry
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, None  # not our child (or already reaped): gone all the same
        if done == 0:
            return  # pidfd readable but not yet reapable; poll again
        code = None if status is None else os.waitstatus_to_exitcode(status)
        with self._lock:
            self._watched.pop(pid, None)
        os.close(pidfd)
        log.info("reaped tree root %d (exit %s)", pid, code)
        self._record(pid, owner, code)

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        suspects: set[int] = set()
        while not self._stop:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            with self._lock:
                by_fd = {fd: pid for pid, (fd, _owner) in self._watched.items()}
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
                    try:
                        self._reap(by_fd[fd])
                    except Exception:  # noqa: BLE001 - the reaper must outlive any one error
                        log.exception("reaping %d failed", by_fd[fd])
            if time.monotonic() >= next_sweep:
                suspects = self._sweep(suspects)
                next_sweep = time.monotonic() + SWEEP_INTERVAL_S

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
        with self._lock:
            zombies -= set(self._watched)
        for pid in zombies & suspects:
            try:
                os.waitpid(pid, os.WNOHANG)
                log.info("reaped stray child %d", pid)
            except ChildProcessError:
                pass
        return zombies - suspects
