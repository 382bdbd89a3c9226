"""Following a process that is not our child.

A kernel restored by CRIU has the helper as its parent, not the Jupyter server, so
``Popen.poll()`` cannot follow it. We hold a pidfd (Linux >= 5.3) and remember the process's
start time, which guards against a recycled pid.
"""

from __future__ import annotations

import os
import select
from dataclasses import dataclass

PF_EXITING = 0x4  # include/linux/sched.h: the task is exiting (killed, or returned)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone or going:
    a zombie, or exiting (a killed kernel frees its memory before it is reported gone, which
    takes a quarter of a second for 3 GiB; the helper's restore lets a replaced tree exit
    beside it, so a failed restore may find the old kernel still exiting)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z" or int(fields[6]) & PF_EXITING:  # fields 3 and 9: state, flags
        return None
    return int(fields[19])


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (those that can be read), through /proc's children."""
    pids, queue = [], [root]
    while queue:
        pid = queue.pop()
        pids.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    queue.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return pids


def tree_rss(root: int) -> int:
    """Resident bytes of a process and its descendants (0 for what cannot be read)."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f
                               if line.startswith("VmRSS:")), 0)
        except (OSError, ValueError):
            continue
    return total


@dataclass
class TrackedProcess:
    """A process we watch by pid, robust to pid reuse."""

    pid: int
    started: int | None
    pidfd: int | None

    @classmethod
    def attach(cls, pid: int) -> TrackedProcess:
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            pidfd = None
        return cls(pid=pid, started=start_time(pid), pidfd=pidfd)

    def alive(self) -> bool:
        if self.pidfd is not None:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            if poller.poll(0):
                return False
        return self.started is not None and start_time(self.pid) == self.started

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
