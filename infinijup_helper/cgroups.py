"""Kernels join the cgroup of the process that asked for them (cgroup v2).

A kernel the root helper starts would otherwise live in the helper's cgroup, outside whatever
memory, CPU and pids limits hold the user who asked (a JupyterHub spawner's per-user slice, a
systemd user session). So the launcher moves itself into the caller's cgroup before it forks
the tree's init (everything below inherits it), and a restoring CRIU is moved there before it
creates any task. The caller's cgroup is read from ``/proc/PID/cgroup`` of the connecting
process once, when its connection is accepted, through its pidfd (the kernel's word, and the
process that connected, not one that took its pid; limits.read_caller_context).

Only the unified (v2) hierarchy is used; where there is none, or with ``--cgroup none``,
kernels stay where the helper put them. Otherwise (``--cgroup caller``, the default) a kernel
goes into its caller's cgroup or does not start: a ``spawn`` or ``restore`` whose caller's
cgroup is unknown (the connecting process had exited before its connection was accepted: the
socket was handed on, say) is refused with ``caller_unknown``, and one whose launcher or CRIU
cannot join it fails (``spawn_failed``, ``cgroup_failed``) before any task of the tree exists.
A caller in the helper's own cgroup needs no move (a container whose cgroupfs is read-only
runs the helper and the Jupyter server side by side in one cgroup).
"""

from __future__ import annotations

import logging
import os

from .proc import Caller
from .protocol import RequestError

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


def parse_cgroup(text: str) -> str | None:
    """The v2 path of a ``/proc/PID/cgroup`` text (its ``0::`` line), or None."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def own_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            return parse_cgroup(f.read())
    except OSError:
        return None


def caller_cgroup_procs(caller: Caller, mount: str | None) -> str | None:
    """The ``cgroup.procs`` file of the v2 cgroup a caller's kernel must join; None when it
    needs no move (no v2 hierarchy, ``--cgroup none``, or the caller is in the helper's own
    cgroup, which the launcher and CRIU inherit). Raises ``caller_unknown`` where the caller's
    cgroup was not known when its connection was accepted, or lies outside the helper's view."""
    if mount is None:
        return None
    path = caller.cgroup
    if path is None:
        raise RequestError(
            "caller_unknown",
            f"the cgroup of the process that connected (pid {caller.pid}) is unknown"
            f"{': ' + caller.unknown if caller.unknown else ''}; a kernel runs in its caller's "
            "cgroup, so it is not started: connect from the process that asks, and keep it "
            "alive until the connection is accepted (or run the helper with --cgroup none)")
    if not path.startswith("/") or "/../" in path + "/":
        raise RequestError(
            "caller_unknown",
            f"the cgroup of the process that connected (pid {caller.pid}), {path!r}, is outside "
            "the helper's cgroup namespace: a kernel runs in its caller's cgroup, so it is not "
            "started (run the helper with --cgroup none to leave kernels in the helper's)")
    if path == own_cgroup():
        return None
    return os.path.join(mount, path.lstrip("/"), "cgroup.procs")


def join(procs: str, pid: int) -> None:
    """Move ``pid`` into the cgroup whose ``cgroup.procs`` is given; ``cgroup_failed`` if
    the kernel refuses (the cgroup is gone, read-only, or cannot take processes)."""
    cgroup = os.path.dirname(procs)
    try:
        fd = os.open(procs, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("cannot move %d into %s: %s", pid, cgroup, exc.strerror)
        raise RequestError(
            "cgroup_failed",
            f"cannot join the caller's cgroup {cgroup}: {exc.strerror}; nothing was started "
            "(a kernel runs in its caller's cgroup; --cgroup none leaves kernels in the "
            "helper's)") from None
