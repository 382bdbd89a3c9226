"""What one user may take from the helper, and the limits their kernels run under.

Per user (uid): open connections, operations running at once, live kernel trees. Per
connection: an idle timeout between requests and a deadline for each request line to arrive
whole (a client that sends a byte now and then holds nothing for long). Root is not limited.

A kernel the helper starts runs with the resource limits of the process that asked for it
(read from ``/proc/PID/limits`` of the connecting process when its connection is accepted,
pinned by a pidfd taken from the socket), lowered further by any configured caps: the helper's
root would otherwise hand out its own, higher limits (RLIMIT_NPROC above all).
"""

from __future__ import annotations

import os
import select
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .cgroups import parse_cgroup
from .proc import Caller, read_proc
from .protocol import RequestError

# /proc/PID/limits row names, by resource.RLIMIT_* name
PROC_LIMIT_NAMES = {
    "RLIMIT_CPU": "Max cpu time",
    "RLIMIT_FSIZE": "Max file size",
    "RLIMIT_DATA": "Max data size",
    "RLIMIT_STACK": "Max stack size",
    "RLIMIT_CORE": "Max core file size",
    "RLIMIT_RSS": "Max resident set",
    "RLIMIT_NPROC": "Max processes",
    "RLIMIT_NOFILE": "Max open files",
    "RLIMIT_MEMLOCK": "Max locked memory",
    "RLIMIT_AS": "Max address space",
    "RLIMIT_LOCKS": "Max file locks",
    "RLIMIT_SIGPENDING": "Max pending signals",
    "RLIMIT_MSGQUEUE": "Max msgqueue size",
    "RLIMIT_NICE": "Max nice priority",
    "RLIMIT_RTPRIO": "Max realtime priority",
    "RLIMIT_RTTIME": "Max realtime timeout",
}
INFINITY = -1  # resource.RLIM_INFINITY


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256
    connections_per_user: int = 32
    ops_per_user: int = 8  # spawn, dump, restore, kill ... running at once
    trees_per_user: int = 64
    idle_timeout_s: float = 600.0  # between two requests on a connection
    request_timeout_s: float = 60.0  # from a request's first byte to its newline
    # Caps on what a kernel gets, on top of the caller's own: name -> (soft, hard), -1 infinite
    rlimit_caps: Mapping[str, tuple[int, int]] = field(default_factory=dict)


def parse_proc_limits(text: str) -> dict[str, tuple[int, int]]:
    by_row = {row: name for name, row in PROC_LIMIT_NAMES.items()}
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines()[1:]:
        for row, name in by_row.items():
            if line.startswith(row + " "):
                fields = line[len(row):].split()
                soft, hard = (INFINITY if v == "unlimited" else int(v) for v in fields[:2])
                out[name] = (soft, hard)
    return out


def _lower(a: int, b: int) -> int:
    if a == INFINITY:
        return b
    if b == INFINITY:
        return a
    return min(a, b)


def read_caller_context(caller: Caller) -> Caller:
    """The caller with what its kernels inherit from it: its resource limits and cgroup,
    read now, once, when its connection is accepted (server.py).

    Read through a pidfd of the peer (``Caller.pidfd``, from SO_PEERPIDFD where the kernel has
    it), checked alive after the reads, so they are those of the process that connected and
    not of one that reused its pid. A connecting process that has already exited (a socket
    handed to a child, the parent gone) leaves them unknown, with the reason: ``spawn`` and
    ``restore`` are then refused (:func:`caller_rlimits`, cgroups.caller_cgroup_procs);
    nothing is read again later.
    """
    gone = (f"the process that connected (pid {caller.pid}) had exited before the helper "
            "accepted the connection")
    pidfd = caller.pidfd
    opened = False
    if pidfd is None:
        try:
            pidfd = os.pidfd_open(caller.pid)
            opened = True
        except OSError:
            return replace(caller, unknown=gone)
    try:
        try:
            with open(f"/proc/{caller.pid}/limits") as f:
                limits_text = f.read()
            with open(f"/proc/{caller.pid}/cgroup") as f:
                cgroup_text = f.read()
        except OSError:
            return replace(caller, unknown=gone)
        info = read_proc(caller.pid)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if poller.poll(0) or info is None:
            return replace(caller, unknown=gone)
        if caller.uid not in info.uids[:2]:
            return replace(caller, unknown=f"the process that connected (pid {caller.pid}) "
                           f"runs as uid {info.uids[1]} now, not as uid {caller.uid}")
    finally:
        if opened:
            os.close(pidfd)
    cgroup = parse_cgroup(cgroup_text)
    return replace(caller, rlimits=parse_proc_limits(limits_text), cgroup=cgroup,
                   unknown=None if cgroup is not None else
                   f"the process that connected (pid {caller.pid}) is in no cgroup v2")


def caller_rlimits(caller: Caller, limits: Limits) -> dict[str, tuple[int, int]]:
    """The connecting process's resource limits (read when its connection was accepted),
    capped by ``limits.rlimit_caps``; ``caller_unknown`` where they could not be read."""
    if caller.rlimits is None:
        raise RequestError(
            "caller_unknown",
            f"the resource limits of the process that connected (pid {caller.pid}) are unknown"
            f"{': ' + caller.unknown if caller.unknown else ''}; a kernel gets its caller's "
            "limits, so it is not started: connect from the process that asks, and keep it "
            "alive until the connection is accepted")
    found = dict(caller.rlimits)
    for name, (soft, hard) in limits.rlimit_caps.items():
        old_soft, old_hard = found.get(name, (INFINITY, INFINITY))
        new_hard = _lower(old_hard, hard)
        found[name] = (_lower(_lower(old_soft, soft), new_hard), new_hard)
    return found
