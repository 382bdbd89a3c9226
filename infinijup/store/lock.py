"""Inter-process locks on the store, built on ``fcntl.flock``.

Two lock files:

``lock``
    Writers (ingest + commit) hold it *shared* for their whole life, so any number of
    processes can snapshot at once. ``gc`` and ``rebuild-index`` hold it *exclusive*: no
    writer can dedup against, or be in the middle of writing, anything gc is deciding about.
``refs.lock``
    Held exclusive for the few milliseconds of a ref compare-and-swap (read tip, write
    commit object, move ref), so concurrent commits to one thread serialize and all land.

``flock`` locks belong to the open file and the kernel drops them when the holder dies, so a
lock left by a killed process (SIGKILL, OOM) is free at once: the pid recorded in the file
is only for messages. Waiting is bounded: after ``timeout`` seconds :class:`StoreLocked`
names the last recorded exclusive holder.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from . import fsutil
from .errors import StoreLocked

DEFAULT_TIMEOUT = 300.0


class FileLock:
    """One flock-based lock; use as a context manager or via acquire/release."""

    def __init__(self, path: Path, *, shared: bool = False,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.path = path
        self.shared = shared
        self.timeout = timeout
        self._fd = -1

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd >= 0

    def acquire(self) -> FileLock:
        """Take the lock, polling until ``timeout``; raise StoreLocked after that."""
        if self.held:
            return self
        fd = fsutil.open_private(self.path, os.O_RDWR | os.O_CREAT)
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise StoreLocked(
                        f"store lock {self.path} is held{holder}; gave up after "
                        f"{self.timeout:g}s") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        if not self.shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {time.time():.3f}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (no-op if not held)."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        if not self.shared:
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 100, 0).decode(errors="replace").split()
    except OSError:
        return ""
    if not text:
        return " by other writers (shared)"
    pid = text[0]
    alive = _pid_alive(int(pid)) if pid.isdigit() else False
    return f" by pid {pid}" + ("" if alive else " (not running here)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
