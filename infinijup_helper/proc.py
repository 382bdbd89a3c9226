"""Reading processes from /proc.

Which pids are kernel trees, and whose, is never read from here: that is the registry's
(registry.py). /proc only says what is *below* a tree root the helper holds, and whether those
processes are the caller's: all four uids (real, effective, saved, filesystem) the caller's,
so a setuid program running in the caller's tree does not count as theirs.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .protocol import RequestError

_SYS_PIDFD_GETFD = 438  # the same number on x86_64 and aarch64
_libc = ctypes.CDLL(None, use_errno=True)


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A copy of descriptor ``fd`` of the process behind ``pidfd`` (``pidfd_getfd(2)``)."""
    got = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return got


@dataclass(frozen=True)
class Caller:
    """Who is on the other end of a connection, from SO_PEERCRED (the kernel's word, not theirs)."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None = field(default=None, compare=False)  # the peer (SO_PEERPIDFD)
    # What a kernel inherits from the connecting process, read once through its pidfd when
    # the connection is accepted (limits.read_caller_context), never later: by then the pid
    # may have exited (the socket handed to another process) or been reused.
    cgroup: str | None = field(default=None, compare=False)  # its v2 cgroup ("0::" path)
    rlimits: Mapping[str, tuple[int, int]] | None = field(default=None, compare=False)
    unknown: str | None = field(default=None, compare=False)  # why those could not be read

    @property
    def is_root(self) -> bool:
        return self.uid == 0


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str  # one letter: R S D Z T t X I ...
    ppid: int
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    gids: tuple[int, ...]
    nspid: tuple[int, ...]  # pid in each nested PID namespace, outermost first

    @property
    def is_namespace_init(self) -> bool:
        return len(self.nspid) >= 2 and self.nspid[-1] == 1

    @property
    def is_zombie(self) -> bool:
        return self.state in ("Z", "X")


def read_proc(pid: int) -> ProcInfo | None:
    """The process's status, or ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    try:
        return ProcInfo(
            pid=pid,
            state=fields.get("State", "?")[:1],
            ppid=int(fields.get("PPid", "0")),
            uids=tuple(int(x) for x in fields["Uid"].split()),
            gids=tuple(int(x) for x in fields["Gid"].split()),
            nspid=tuple(int(x) for x in fields.get("NSpid", str(pid)).split()),
        )
    except (KeyError, ValueError):
        return None  # the process vanished while we read it


def is_alive(pid: int) -> bool:
    info = read_proc(pid)
    return info is not None and not info.is_zombie


def owns(caller: Caller, info: ProcInfo) -> bool:
    """All four uids are the caller's (root owns everything)."""
    return caller.is_root or all(uid == caller.uid for uid in info.uids)


def tree_members(root: int) -> list[int]:
    """``root`` and all its descendants, through /proc/PID/task/TID/children."""
    members, queue = [], [root]
    while queue:
        pid = queue.pop()
        members.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    queue.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return members


def authorize_members(caller: Caller, root: int, alive: Callable[[], bool]) -> list[int]:
    """The processes below a held tree root, each of which must be the caller's (no setuid
    program's memory in the images), and there must be one: a tree whose kernel has gone is
    not worth dumping. ``alive`` (the root's pidfd) is checked after the walk, so the children
    read from /proc are those of the held root, not of a process that took its pid.

    Racy by nature (a process may exec a setuid binary a moment later); the dumped images are
    checked again afterwards. This early check keeps ``leave_running=False`` from stopping a
    tree whose images would then be refused.
    """
    members = tree_members(root)[1:]
    if not alive():
        raise RequestError("no_such_process", f"the tree of {root} has exited")
    if not members:
        raise RequestError("no_such_process", f"the tree of {root} has no process but its init")
    if caller.is_root:
        return members
    for pid in members:
        info = read_proc(pid)
        if info is not None and not owns(caller, info):
            raise RequestError(
                "permission_denied",
                f"process {pid} in the tree of {root} runs as uid {info.uids[1]}, not {caller.uid}",
            )
    return members
