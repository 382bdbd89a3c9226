"""Reading processes from /proc, and the authorization rules built on it.

Every op that names a pid goes through :func:`authorize_pid`. The caller owns a process when
all four of its uids (real, effective, saved, filesystem) are the caller's, so a setuid program
running in the caller's tree does not count as theirs. A tree root the helper started is the
exception: its init (nsinit) runs as root (see nsinit.py) and is owned by the uid named in its
``--owner`` flag, which nobody but root can set. Ops that act on a whole tree need the pid to be
the init of its own PID namespace, which is what makes "the tree" well defined.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .protocol import RequestError


@dataclass(frozen=True)
class Caller:
    """Who is on the other end of a connection, from SO_PEERCRED (the kernel's word, not theirs)."""

    pid: int
    uid: int
    gid: int

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


NSINIT_SUFFIX = "/infinijup_helper/nsinit.py"


def nsinit_owner(info: ProcInfo) -> int | None:
    """The ``--owner`` uid of a root-owned tree init the helper started, else None."""
    if any(uid != 0 for uid in info.uids):
        return None
    try:
        with open(f"/proc/{info.pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return None
    # [python, "-I", ".../infinijup_helper/nsinit.py", "--owner", "UID", ""]
    if len(args) != 6 or args[1] != b"-I" or not args[2].endswith(NSINIT_SUFFIX.encode()):
        return None
    if args[3] != b"--owner" or not args[4].isdigit() or args[5] != b"":
        return None
    return int(args[4])


def is_tree_root(info: ProcInfo) -> bool:
    """A tree the helper launched or restored: the init of its own PID namespace, or (where
    kernels run without one, see spawn.py) a root-owned nsinit carrying its ``--owner`` mark,
    which only root can have started."""
    return info.is_namespace_init or nsinit_owner(info) is not None


def owner_of(info: ProcInfo) -> int | None:
    """Whose process this is, by the rules above; None when its uids are mixed."""
    if len(set(info.uids)) == 1 and info.uids[0] != 0:
        return info.uids[0]
    marked = nsinit_owner(info)
    if marked is not None:
        return marked
    return 0 if set(info.uids) == {0} else None


CAP_SYS_RESOURCE = 24


def has_capability(cap: int, pid: int | str = "self") -> bool:
    """Whether a process's effective capability set holds ``cap``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def is_alive(pid: int) -> bool:
    info = read_proc(pid)
    return info is not None and not info.is_zombie


def authorize_pid(caller: Caller, pid: int, *, tree_root: bool) -> ProcInfo:
    """The live process ``pid`` if ``caller`` may act on it; else raise a :class:`RequestError`."""
    info = read_proc(pid)
    if info is None or info.is_zombie:
        raise RequestError("no_such_process", f"no running process with pid {pid}")
    if not caller.is_root and owner_of(info) != caller.uid:
        raise RequestError(
            "permission_denied", f"process {pid} does not belong to uid {caller.uid}"
        )
    if tree_root and not is_tree_root(info):
        raise RequestError(
            "bad_request",
            f"process {pid} is not the root of a kernel tree (not a tree the helper "
            "spawned or restored)",
        )
    return info


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


def authorize_tree(caller: Caller, root: int) -> None:
    """Every process below the root must be the caller's (no setuid program's memory in the
    images), and there must be one: a tree whose kernel has gone is not worth dumping.

    Racy by nature (a process may exec a setuid binary a moment later); the dumped images are
    checked again afterwards. This early check keeps ``leave_running=False`` from stopping a
    tree whose images would then be refused.
    """
    members = tree_members(root)[1:]
    if not members:
        raise RequestError("no_such_process", f"the tree of {root} has no process but its init")
    if caller.is_root:
        return
    for pid in members:
        info = read_proc(pid)
        if info is not None and any(uid != caller.uid for uid in info.uids):
            raise RequestError(
                "permission_denied",
                f"process {pid} in the tree of {root} runs as uid {info.uids[1]}, not {caller.uid}",
            )
