"""Finding a kernel tree that a restore left behind when the helper died mid-restore.

The helper runs CRIU as a child; if the helper is killed while CRIU restores a kernel, CRIU
carries on and the restored tree comes up (re-parented to init) although nobody got its pid:
the server sees ``helper_disconnected``. That tree listens on the kernel's own endpoints (they are
in the snapshot), so it is found by its listening shell socket: the process holding that socket,
below a tree root the helper recorded as ours. The helper records every tree it restores,
before CRIU lets it run, in a file only root can write (``<socket>.trees.json``, pid and start
time and owner; see infinijup_helper/registry.py): that record, not a command line anyone
could imitate, says which tree is ours.
"""

from __future__ import annotations

import json
import os
import stat
import time

from .. import config
from ..process import start_time
from ..unix_diag import TCP_LISTEN, unix_sockets

REGISTRY_SUFFIX = ".trees.json"


def _listening_inodes(shell_path: str) -> set[str]:
    """Inodes of the unix sockets listening on ``shell_path`` (CRIU binds them as the
    kernel's owner, in a directory only that owner can enter)."""
    try:
        sockets = unix_sockets()
    except OSError:
        return set()
    return {str(s.inode) for s in sockets.values()
            if s.state == TCP_LISTEN and s.name == shell_path}


def _holder(inodes: set[str]) -> int | None:
    wanted = {f"socket:[{i}]" for i in inodes}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{name}/fd"):
                if os.readlink(f"/proc/{name}/fd/{fd}") in wanted:
                    return int(name)
        except OSError:
            continue
    return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def recorded_roots(uid: int, path: str | None = None) -> dict[int, int]:
    """pid -> start time of ``uid``'s trees in the helper's registry (empty if unreadable or
    not root's alone)."""
    path = path or config.helper_socket() + REGISTRY_SUFFIX
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return {}
        try:
            doc = json.loads(f.read(16 << 20))
            if doc.get("boot_id") != _boot_id():  # another boot's pids name other processes
                return {}
            return {int(e["pid"]): int(e["start"]) for e in doc["trees"]
                    if int(e["owner"]) == uid}
        except (ValueError, KeyError, TypeError):
            return {}


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def tree_root_of(pid: int, uid: int, socket_path: str | None = None) -> int | None:
    """The tree root above ``pid`` that the helper (of ``socket_path``, default ours) recorded
    as ``uid``'s, if any."""
    roots = recorded_roots(uid, socket_path + REGISTRY_SUFFIX if socket_path else None)
    seen = 0
    while pid and pid > 1 and seen < 8:
        if pid in roots and start_time(pid) == roots[pid]:
            return pid
        pid = _ppid(pid) or 0
        seen += 1
    return None


def _criu_running() -> bool:
    for name in os.listdir("/proc"):
        if name.isdigit():
            argv = _cmdline(int(name))
            if len(argv) >= 2 and os.path.basename(argv[0]) == "criu" and argv[1] == "swrk":
                return True
    return False


def find_restored_tree(shell_path: str, uid: int | None = None, grace: float = 5.0,
                       timeout: float = 30.0, socket_path: str | None = None) -> int | None:
    """The root pid of a tree serving the shell endpoint ``shell_path`` for ``uid`` (default:
    ours).

    Looks for ``grace`` seconds, and on while some CRIU is still at work (the orphaned
    restore may not have bound the port yet) or the port is bound by a task not yet found,
    at most ``timeout`` seconds in all.
    """
    uid = os.geteuid() if uid is None else uid
    start = time.monotonic()
    while True:
        busy = _criu_running()
        inodes = _listening_inodes(shell_path)
        holder = _holder(inodes) if inodes else None
        if holder is not None:
            root = tree_root_of(holder, uid, socket_path)
            if root is not None:
                return root
        elapsed = time.monotonic() - start
        if elapsed > timeout or (elapsed > grace and not busy and not inodes):
            return None
        time.sleep(0.05)
