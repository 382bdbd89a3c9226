"""What one user may take from the helper, and the limits their kernels run under.

Per user (uid): open connections, operations running at once, live kernel trees. Per
connection: an idle timeout between requests and a deadline for each request line to arrive
whole (a client that sends a byte now and then holds nothing for long). Root is not limited.

A kernel the helper starts runs with the resource limits of the process that asked for it
(read from ``/proc/PID/limits`` of the connecting process, pinned by a pidfd taken from the
socket), lowered further by any configured caps: the helper's root would otherwise hand out
its own, higher limits (RLIMIT_NPROC above all).
"""

from __future__ import annotations

import os
import select
from collections.abc import Mapping
from dataclasses import dataclass, field

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


def caller_rlimits(caller: Caller, limits: Limits) -> dict[str, tuple[int, int]]:
    """The connecting process's resource limits, capped by ``limits.rlimit_caps``.

    Read through a pidfd of the peer (``Caller.pidfd``, from SO_PEERPIDFD where the kernel has
    it), checked alive after the read, so the limits are those of the process that connected
    and not of one that reused its pid.
    """
    pidfd = caller.pidfd
    opened = False
    if pidfd is None:
        try:
            pidfd = os.pidfd_open(caller.pid)
            opened = True
        except OSError:
            raise RequestError("no_such_process", "the calling process has exited") from None
    try:
        try:
            with open(f"/proc/{caller.pid}/limits") as f:
                text = f.read()
        except OSError:
            raise RequestError("no_such_process", "the calling process has exited") from None
        info = read_proc(caller.pid)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if poller.poll(0) or info is None or info.uids[0] != caller.uid:
            raise RequestError("no_such_process", "the calling process has exited")
    finally:
        if opened:
            os.close(pidfd)
    found = parse_proc_limits(text)
    for name, (soft, hard) in limits.rlimit_caps.items():
        old_soft, old_hard = found.get(name, (INFINITY, INFINITY))
        new_hard = _lower(old_hard, hard)
        found[name] = (_lower(_lower(old_soft, soft), new_hard), new_hard)
    return found
