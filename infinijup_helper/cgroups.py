"""Kernels join the cgroup of the process that asked for them (cgroup v2).

A kernel the root helper starts would otherwise live in the helper's cgroup, outside whatever
memory, CPU and pids limits hold the user who asked (a JupyterHub spawner's per-user slice, a
systemd user session). So the launcher moves itself into the caller's cgroup before it forks
the tree's init (everything below inherits it), and a restoring CRIU is moved there before it
creates any task. The caller's cgroup is read from ``/proc/PID/cgroup`` of the connecting
process (the kernel's word, pinned by its pidfd).

Only the unified (v2) hierarchy is used. Where there is none, or the caller's cgroup cannot
take processes (an inner cgroup with controllers enabled for its children: cgroup v2's
"no internal processes" rule), kernels stay where the helper put them: ``--cgroup none`` says
so explicitly; the default ``caller`` falls back to that with a warning in the log.
"""

from __future__ import annotations

import logging
import os
import select

from .proc import Caller

log = logging.getLogger(__name__)


def unified_mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted, if anywhere."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split()[:1] == ["cgroup2"]:
                    return left.split()[4]
    except OSError:
        pass
    return None


def caller_cgroup_procs(caller: Caller, mount: str | None) -> str | None:
    """The ``cgroup.procs`` file of the caller's v2 cgroup, or None."""
    if mount is None:
        return None
    try:
        with open(f"/proc/{caller.pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    if caller.pidfd is not None:
        poller = select.poll()
        poller.register(caller.pidfd, select.POLLIN)
        if poller.poll(0):
            return None  # the caller has gone: that was somebody else's /proc entry
    for line in lines:
        if line.startswith("0::"):
            path = line[3:]
            if not path.startswith("/") or "/../" in path + "/":
                return None
            procs = os.path.join(mount, path.lstrip("/"), "cgroup.procs")
            return procs if os.path.exists(procs) else None
    return None


def join(procs: str, pid: int) -> bool:
    """Move ``pid`` into the cgroup whose ``cgroup.procs`` is given; False if refused."""
    try:
        fd = os.open(procs, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("cannot join %s: %s", procs, exc.strerror)
        return False
    try:
        os.write(fd, str(pid).encode())
        return True
    except OSError as exc:
        log.warning("cannot move %d into %s: %s", pid, procs, exc.strerror)
        return False
    finally:
        os.close(fd)
