"""Whose credentials a step runs with: the caller's, plus only the capabilities it needs.

The helper is root, but almost nothing it does for a user needs root. A non-root caller's
kernel tree, its CRIU dumps and its CRIU restores all run with the caller's uid, gid and
groups, and a few capabilities (ambient, so they survive the exec):

* the tree's init (nsinit), in a PID namespace: CAP_SYS_ADMIN, because CRIU's parasite,
  running with the init's credentials, mounts a /proc for the namespace during a dump; and
  CAP_SETGID, to leave out the one extra group it holds (:data:`NSINIT_GROUP`, which lets it
  create that mount point in its root-owned cwd) when it forks the kernel. Without a PID
  namespace the init holds nothing. The kernel never holds a capability.
* CRIU dump (``--unprivileged`` mode): CAP_CHECKPOINT_RESTORE, CAP_SYS_PTRACE, CAP_SYS_ADMIN
  (/proc/PID/map_files), CAP_NET_ADMIN (TCP repair). Since it runs with the caller's ids, the
  kernel lets it read resource limits only of the caller's own processes (no CAP_SYS_RESOURCE
  is needed, or given): CRIU cannot dump anybody else's process.
* CRIU restore (``--unprivileged`` mode): CAP_CHECKPOINT_RESTORE, CAP_SYS_PTRACE,
  CAP_SYS_ADMIN (the PID namespace, the init's capability), CAP_SETGID (the init's group),
  CAP_SETPCAP (restoring the capability bounding set). No CAP_DAC_* and no CAP_FOWNER: every
  file, directory, cwd and unix socket path in the images is opened, created, bound or
  unlinked by the kernel's permission checks *as the caller*, so images can reach nothing the
  caller could not reach. No CAP_SETUID either: CRIU would then switch the restored root task
  to uid 0 while it opens files.

Root callers keep today's model: a root-owned init and CRIU as root.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass

NSINIT_GROUP = "infinijup-nsinit"

CAP_SETGID = 6
CAP_SETPCAP = 8
CAP_NET_ADMIN = 12
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_CHECKPOINT_RESTORE = 40

CAP_NAMES = {
    CAP_SETGID: "setgid",
    CAP_SETPCAP: "setpcap",
    CAP_NET_ADMIN: "net_admin",
    CAP_SYS_PTRACE: "sys_ptrace",
    CAP_SYS_ADMIN: "sys_admin",
    CAP_SYS_RESOURCE: "sys_resource",
    CAP_CHECKPOINT_RESTORE: "checkpoint_restore",
}

NSINIT_CAPS_PIDNS = (CAP_SYS_ADMIN, CAP_SETGID)
CRIU_DUMP_CAPS = (CAP_CHECKPOINT_RESTORE, CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_NET_ADMIN)
CRIU_RESTORE_CAPS = (CAP_CHECKPOINT_RESTORE, CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_SETGID,
                     CAP_SETPCAP)


@dataclass(frozen=True)
class RunAs:
    """Ids and capabilities for a process the helper starts; ``None`` where root runs it."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    caps: tuple[int, ...] = ()

    def setpriv_argv(self, setpriv: str) -> list[str]:
        """A ``setpriv`` prefix that execs the rest of the command line as these credentials.

        ``setpriv`` (util-linux) does the setresuid/setgroups/ambient-capability dance in the
        child after the fork; the helper is threaded and must not do it in a pre-exec hook.
        No ``--no-new-privs``: CRIU would pass that on to every restored process.
        """
        caps = ",".join(f"+{CAP_NAMES[c]}" for c in self.caps)
        argv = [setpriv, "--reuid", str(self.uid), "--regid", str(self.gid)]
        argv += ["--groups", ",".join(map(str, self.groups))] if self.groups else ["--clear-groups"]
        if caps:
            argv += ["--inh-caps", "-all," + caps, "--ambient-caps", "-all," + caps]
        else:
            argv += ["--inh-caps", "-all"]
        return [*argv, "--"]


def user_groups(uid: int, gid: int) -> tuple[int, ...]:
    """The uid's primary gid and supplementary groups, as initgroups(3) would set them."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return (gid,)
    return tuple(dict.fromkeys([gid, *os.getgrouplist(name, gid)]))


def find_setpriv() -> str:
    path = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise RuntimeError("setpriv (util-linux) is needed to run CRIU as the calling user")
    return path


def nsinit_group() -> int:
    """The gid of :data:`NSINIT_GROUP`, created (a system group, no members) when missing.

    Only tree inits hold it: it lets them create CRIU's temporary mount point in their
    root-owned cwd, which the user's own processes cannot write.
    """
    try:
        return grp.getgrnam(NSINIT_GROUP).gr_gid
    except KeyError:
        pass
    groupadd = shutil.which("groupadd", path="/usr/sbin:/sbin:/usr/bin:/bin")
    if groupadd is None:
        raise RuntimeError(f"group {NSINIT_GROUP} is missing and groupadd is not installed; "
                           f"create it: groupadd --system {NSINIT_GROUP}")
    subprocess.run([groupadd, "--system", NSINIT_GROUP], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return grp.getgrnam(NSINIT_GROUP).gr_gid


def has_capability(cap: int, pid: int | str = "self") -> bool:
    """Whether a process's effective capability set holds ``cap``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> cap & 1)
    return False
