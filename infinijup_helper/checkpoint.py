"""The dump and restore pipelines: their contexts and stages (see stages.py for the runner).

Both keep CRIU away from anything the caller can touch while it runs as root:

* a dump writes into a root-only staging dir; only after the images pass the credential check
  are they sealed, given to the caller and renamed into ``images_dir`` in one step;
* a restore first copies the sealed metadata files (checking each against the seal) and
  hard-links the bulk page files into a root-only staging dir, and CRIU reads only that.
"""

from __future__ import annotations

import errno
import hashlib
import os
import select
import signal
import stat
import time
from dataclasses import dataclass, field

from .criu import (
    Criu,
    check_creds,
    check_page_files,
    image_names,
    private_page_files,
    tree_tasks,
)
from .paths import Staging, WorkDirs
from .proc import Caller, read_proc, tree_members
from .protocol import RequestError
from .reaper import Reaper
from .retarget import RetargetPlan
from .seal import FileSeal, Sealer, is_sealed_name, untrusted
from .stages import StageBase

KILL_TIMEOUT_S = 30.0
COPY_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------
# Killing a tree


def terminate_tree(pidfd: int, pid: int, reaper: Reaper, timeout: float = KILL_TIMEOUT_S) -> None:
    """SIGKILL a namespace init (through its pidfd, so never a recycled pid) and wait until it
    is gone: reaped by us if it is our child, else exited (its own parent reaps it).

    Killing a PID namespace's init makes the kernel kill every other process in it, and the
    init only becomes reapable once they are all gone, so this waits for the whole tree.
    """
    info = read_proc(pid)
    members: dict[int, int] = {}
    if info is not None and not info.is_namespace_init:
        # No PID namespace to take the tree down with its init: end every member too.
        for member in tree_members(pid)[1:]:
            try:
                members[member] = os.pidfd_open(member)
                os.kill(member, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
    try:
        _kill_root(pidfd, pid, reaper, timeout)
    finally:
        _reap_members(members, timeout)


def _reap_members(members: dict[int, int], timeout: float) -> None:
    """Wait until each member has exited and been reaped: its pid must be free for a restore.

    Orphaned by the init's death, members are reparented to the helper (a subreaper), whose
    reaper only waits for tree roots: reap them here.
    """
    deadline = time.monotonic() + timeout
    for member, fd in members.items():
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000))
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(member, os.WNOHANG)[0] == member:
                        break
                except ChildProcessError:
                    info = read_proc(member)
                    if info is None:
                        break  # reaped by its own parent
                time.sleep(0.005)
        finally:
            os.close(fd)


def _kill_root(pidfd: int, pid: int, reaper: Reaper, timeout: float) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if reaper.is_tracked(pid):
        if reaper.wait_reaped(pid, timeout) is None and reaper.is_tracked(pid):
            raise RequestError("timeout", f"process {pid} did not exit within {timeout:.0f} s")
        return
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if not poller.poll(int(timeout * 1000)):
        raise RequestError("timeout", f"process {pid} did not exit within {timeout:.0f} s")
    # Exited; give its parent (init, after a helper restart) a moment to reap it.
    while time.monotonic() < deadline:
        info = read_proc(pid)
        if info is None or info.is_zombie:
            return
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------
# Dump


@dataclass
class DumpJob:
    caller: Caller
    pid: int
    leave_running: bool
    allowed_gids: tuple[int, ...]
    staging: Staging
    parent_fd: int
    name: str
    image_bytes: int = 0


class CriuDump(StageBase):
    name = "dump"

    def __init__(self, criu: Criu) -> None:
        self.criu = criu

    def run(self, job: DumpJob) -> None:
        self.criu.dump(job.pid, job.staging.fd, leave_running=job.leave_running)


class VerifyDumpedCreds(StageBase):
    """Every dumped task must be the caller's: no dumping a setuid program's memory."""

    name = "verify"

    def __init__(self, criu: Criu) -> None:
        self.criu = criu

    def run(self, job: DumpJob) -> None:
        # A kernel that died as the dump began leaves only its init in the images: that is
        # no snapshot of a kernel, refuse it rather than publish it.
        if len(tree_tasks(self.criu, job.staging.fd)) < 2:
            raise RequestError("criu_failed", "CRIU dump failed: the kernel exited while it "
                               "was being dumped (only its init was left to dump)")
        if not job.caller.is_root:
            check_creds(self.criu, job.staging.fd, job.caller.uid, job.allowed_gids)


class PublishImages(StageBase):
    name = "publish"

    def __init__(self, criu: Criu, sealer: Sealer, work: WorkDirs) -> None:
        self.criu = criu
        self.sealer = sealer
        self.work = work

    def run(self, job: DumpJob) -> None:
        size_only = private_page_files(self.criu, job.staging.fd)
        self.sealer.seal(job.staging.fd, job.caller.uid, size_only)
        job.image_bytes = sum(
            e.stat(follow_symlinks=False).st_size
            for e in os.scandir(job.staging.fd)
            if e.is_file(follow_symlinks=False)
        )
        self.work.publish(job.staging, job.parent_fd, job.name, job.caller)


# ---------------------------------------------------------------------------------------------
# Restore


@dataclass
class RestoreJob:
    caller: Caller
    images_fd: int
    allowed_gids: tuple[int, ...]
    staging: Staging
    replace_pid: int | None = None
    replace_pidfd: int | None = None
    pid: int | None = None
    staged: list[str] = field(default_factory=list)
    gpu_map: tuple[tuple[str, str], ...] = ()
    retarget: RetargetPlan = field(default_factory=RetargetPlan)  # see retarget.py
    retargeted: dict = field(default_factory=dict)


def _copy_checked(src: int, dst_dir: int, name: str, expect: FileSeal | None) -> None:
    dst = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dst_dir,
    )
    try:
        os.lseek(src, 0, os.SEEK_SET)
        size = 0
        digest = hashlib.sha256()
        while chunk := os.read(src, COPY_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view) :]
    finally:
        os.close(dst)
    if expect is not None and (size != expect.size or digest.hexdigest() != expect.sha256):
        raise untrusted(f"{name} differs from what was dumped")


def _link_or_copy(src: int, dst_dir: int, name: str) -> None:
    try:
        os.link(f"/proc/self/fd/{src}", name, dst_dir_fd=dst_dir, follow_symlinks=True)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        dst = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dst_dir,
        )
        try:
            left = os.fstat(src).st_size
            offset = 0
            while left > 0:
                n = os.copy_file_range(src, dst, left, offset)
                if n == 0:
                    break
                offset += n
                left -= n
        finally:
            os.close(dst)


class StageImages(StageBase):
    """Bring the images into the root-only staging dir, checked against their seal."""

    name = "stage"

    def __init__(self, criu: Criu, sealer: Sealer) -> None:
        self.criu = criu
        self.sealer = sealer

    def run(self, job: RestoreJob) -> None:
        trusted = job.caller.is_root  # root may restore anything, sealed or not
        seals = None
        if not trusted:
            seal = self.sealer.read(job.images_fd)
            if seal.owner != job.caller.uid:
                raise untrusted(f"they were dumped for uid {seal.owner}, not {job.caller.uid}")
            seals = seal.files
        names = (
            sorted(seals)
            if seals is not None
            else [n for n in image_names(job.images_fd) if is_sealed_name(n)]
        )
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=job.images_fd)
            except FileNotFoundError:
                raise untrusted(f"{name} is missing") from None
            except OSError as exc:
                raise untrusted(f"{name} cannot be opened: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise untrusted(f"{name} is not a regular file")
                if not trusted and st.st_uid != job.caller.uid:
                    raise untrusted(f"{name} is not owned by uid {job.caller.uid}")
                seal = seals[name] if seals is not None else None
                if seal is not None and st.st_size != seal.size:
                    raise untrusted(f"{name} has changed size since it was dumped")
                if seal is not None and seal.sha256 is None:
                    _link_or_copy(fd, job.staging.fd, name)  # private memory: size suffices
                elif seal is None and name.startswith("pages-"):
                    _link_or_copy(fd, job.staging.fd, name)  # root's restore: no checks
                else:
                    _copy_checked(fd, job.staging.fd, name, seal)
            finally:
                os.close(fd)
            job.staged.append(name)
        check_page_files(self.criu, job.staging.fd)  # before the kill stage: refuse early
        if not trusted:
            check_creds(self.criu, job.staging.fd, job.caller.uid, job.allowed_gids)


class KillReplaced(StageBase):
    name = "kill"

    def __init__(self, reaper: Reaper) -> None:
        self.reaper = reaper

    def run(self, job: RestoreJob) -> None:
        if job.replace_pid is not None and job.replace_pidfd is not None:
            terminate_tree(job.replace_pidfd, job.replace_pid, self.reaper)


class CriuRestore(StageBase):
    name = "restore"

    def __init__(self, criu: Criu, reaper: Reaper) -> None:
        self.criu = criu
        self.reaper = reaper

    def run(self, job: RestoreJob) -> None:
        job.pid = self.criu.restore(job.staging.fd)
        self.reaper.track(job.pid, job.caller.uid)
