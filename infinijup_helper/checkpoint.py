"""The dump and restore pipelines: their contexts and stages (see stages.py for the runner).

Both keep CRIU's inputs and outputs out of the caller's reach while it runs (as the caller, for
a non-root caller: see creds.py):

* a dump writes into a staging dir only the helper can reach by path; only after the images
  pass the credential check are they sealed, given to the caller and renamed into
  ``images_dir`` in one step;
* a restore first copies the sealed metadata files (checking each against the seal) and
  hard-links the bulk page files into such a staging dir, and CRIU reads only that; while it
  runs, the linked page files are watched for a change of size (see ``_link_or_copy``).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import select
import signal
import stat
import time
from dataclasses import dataclass, field

from .creds import RunAs
from .criu import (
    Criu,
    CriuFailed,
    check_creds,
    check_page_files,
    image_names,
    private_page_files,
    running_criu,
    tree_tasks,
)
from .cuda_stage import GPU_RESTORED_WHOLE, images_map_cuda, uses_nvidia
from .lazy_pages import PageStream, processes_to_serve
from .page_source import PageSource
from .paths import Staging, WorkDirs
from .proc import Caller, read_proc, tree_members
from .protocol import RequestError
from .registry import Held, Registry, start_time
from .retarget import FILES_IMAGE, RetargetPlan
from .seal import FileSeal, Sealer, is_sealed_name, untrusted
from .stages import StageBase
from .unix_peers import (
    closed_ends,
    detached_inodes,
    is_new_connection,
    shut_accepted,
    shut_connections,
    tree_socket_ids,
)

log = logging.getLogger(__name__)

KILL_TIMEOUT_S = 30.0
REAP_FAILED_WAIT_S = 5.0  # reap_failed_restore: at most this long for its tasks to be gone
DUMP_TRIES = 3
COPY_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------
# Killing a tree


def terminate_tree(tree: Held, timeout: float = KILL_TIMEOUT_S) -> None:
    """SIGKILL a held tree's root (through its pidfd, so never a recycled pid) and wait until
    it is gone, reaped through its pidfd when it is the helper's child.

    Killing a PID namespace's init makes the kernel kill every other process in it, and the
    init only becomes reapable once they are all gone, so this waits for the whole tree.
    Without a PID namespace each member is killed through a pidfd taken while it was a
    verified descendant of the held root.
    """
    members = {} if tree.tree.namespace else member_pidfds(tree)
    try:
        for fd in members.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_root(tree)
        if not _wait_readable(tree.pidfd, timeout):
            raise RequestError("timeout", f"process {tree.pid} did not exit within {timeout:.0f} s")
        tree.reap()
        _reap_members(members, timeout)
    finally:
        for fd in members.values():
            os.close(fd)


def reap_dumped(tree: Held, members: dict[int, int], timeout: float = KILL_TIMEOUT_S) -> None:
    """After a dump that did not leave the tree running (CRIU ended it): wait until its root
    and ``members`` (pid -> pidfd, taken before the dump: ``member_pidfds``) are gone and
    reaped. Without a PID namespace a restore of the images takes those very pids back; left
    to the reaper's sweep, a member would hold its pid for 5 to 10 s more."""
    if not _wait_readable(tree.pidfd, timeout):
        raise RequestError("timeout", f"process {tree.pid} did not exit within {timeout:.0f} s")
    tree.reap()
    _reap_members(members, timeout)


def kill_root(tree: Held) -> None:
    """SIGKILL a held tree's root through its pidfd, without waiting for its exit."""
    try:
        signal.pidfd_send_signal(tree.pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def nice_threads(pids: list[int]) -> None:
    """Every thread of these processes (each held by a pidfd) at the lowest priority: a tree
    killed to exit beside a restore frees its memory as it exits, and on a machine of few
    cores that takes CPU from the restore. A thread id is read from the task dir of a process
    that is held; Linux hands ids out cyclically, so one reused between that read and the
    call would need the whole id space to go round in between (the worst it could do is
    lower another process's priority)."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)
            except (OSError, ValueError):
                pass


def member_pidfds(tree: Held) -> dict[int, int]:
    """pid -> pidfd of every process below a held root, each opened while it was a descendant
    of that root (checked after the open, so a pid recycled meanwhile is left out)."""
    out: dict[int, int] = {}
    for member in tree_members(tree.pid)[1:]:
        try:
            fd = os.pidfd_open(member)
        except OSError:
            continue
        if _descends_from(member, tree.pid) and tree.alive():
            out[member] = fd
        else:
            os.close(fd)
    return out


def kill_aborted_restore(registry: Registry, recorded: int | None) -> None:
    """After CRIU was killed mid-restore: end the tree it was making. Restored roots are the
    helper's children (``rst_sibling``): one this restore recorded, or one still named by
    CRIU (not yet recorded, so not anybody's tree). Each is killed through a pidfd taken
    while it was the helper's child, its descendants with it."""
    me = os.getpid()
    for child in tree_members(me)[1:]:
        if read_proc(child) is None or read_proc(child).ppid != me:
            continue
        if child != recorded and registry.lookup(child) is not None:
            continue  # somebody's live tree
        try:
            fd = os.pidfd_open(child)
        except OSError:
            continue
        try:
            info = read_proc(child)
            if info is None or info.ppid != me:
                continue
            if child != recorded and _comm(child) != "criu":
                continue  # a launcher, a CRIU, an init not yet recorded: not ours to end
            held: list[int] = []
            try:
                for member in tree_members(child)[1:]:
                    try:
                        member_fd = os.pidfd_open(member)
                    except OSError:
                        continue
                    if _descends_from(member, child):  # checked after the open: not recycled
                        held.append(member_fd)
                    else:
                        os.close(member_fd)
                for member_fd in held:
                    _signal_quietly(member_fd)
                _signal_quietly(fd)
            finally:
                for member_fd in held:
                    os.close(member_fd)
            log.warning("killed the tree %d of an aborted restore", child)
        finally:
            os.close(fd)


def end_failed_restore(job: RestoreJob, pids: set[int], since: float) -> None:
    """After CRIU failed a restore, nothing runs from its images, and nothing of it holds their
    pids. With no PID namespace (the GPU hosts) the tasks CRIU made have the images' own
    pids: left to the reaper, a second restore of the same images right after could fail
    with "File exists". A tree recorded at post-restore is ended and reaped now; the other
    tasks CRIU made and ended are zombies of the helper (the root is its child, CRIU's
    ``rst_sibling``; the others are reparented to it, the child subreaper), reaped now too."""
    if job.pid is not None:
        try:
            with job.registry.hold(job.caller.uid, job.pid) as held:
                terminate_tree(held)
        except RequestError:  # gone already, or the reaper is at it: let it finish
            job.registry.wait_gone(job.pid, KILL_TIMEOUT_S)
    reap_failed_restore(job.registry, pids, since)


def reap_failed_restore(registry: Registry, pids: set[int], since: float) -> None:
    """Reap the zombies a failed restore left (end_failed_restore). Taken: a zombie child of
    the helper, held by a pidfd, with one of the images' pids, made since the restore began,
    not a tree of the registry and not a CRIU the helper runs (its op waits for it), once it
    has exited (CRIU killed it: at most ``REAP_FAILED_WAIT_S`` in all is waited for that);
    otherwise the reaper's sweep takes them, 5 to 10 s later. A task CRIU failed early may
    still bear CRIU's name: the name does not tell them apart."""
    me = os.getpid()
    deadline = time.monotonic() + REAP_FAILED_WAIT_S
    for pid in sorted(pids):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            info = read_proc(pid)
            if (info is None or info.ppid != me or pid in running_criu()
                    or registry.lookup(pid) is not None
                    or (start_time(pid) or 0) / os.sysconf("SC_CLK_TCK") < since - 0.05):
                continue
            # CRIU killed the tasks it made: one may still be on its way out (a busy machine)
            if not info.is_zombie and not _wait_readable(fd, max(0.0, deadline - time.monotonic())):
                continue
            os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            log.info("reaped %d, a task of a failed restore", pid)
        except ChildProcessError:
            pass
        finally:
            os.close(fd)


PF_EXITING = 0x4


def _exiting(pid: int) -> bool:
    """The task is in do_exit (not yet a zombie: its pidfd does not tell yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return bool(int(fields[6]) & PF_EXITING) or fields[0] in (b"Z", b"X")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _signal_quietly(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _descends_from(pid: int, root: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        info = read_proc(pid)
        if info is None:
            return False
        if info.ppid == root:
            return True
        pid, seen = info.ppid, seen + 1
    return False


def _wait_readable(pidfd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(int(timeout * 1000)))


def _reap_members(members: dict[int, int], timeout: float) -> None:
    """Wait until each member has exited and been reaped: its pid must be free for a restore.

    Orphaned by the init's death, members are reparented to the helper (a subreaper), whose
    reaper only waits for tree roots: reap them here, through their pidfds.
    """
    deadline = time.monotonic() + timeout
    for member, fd in members.items():
        _wait_readable(fd, max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            try:
                if os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG) is not None:
                    break
            except ChildProcessError:
                info = read_proc(member)
                if info is None or not _descends_from(member, os.getpid()):
                    break  # reaped by its own parent
            time.sleep(0.005)


# ---------------------------------------------------------------------------------------------
# Dump


@dataclass
class DumpJob:
    caller: Caller
    tree: Held
    leave_running: bool
    allowed_gids: tuple[int, ...]
    staging: Staging
    parent_fd: int
    name: str
    run_as: RunAs | None = None  # CRIU as the caller (None: as root)
    init_groups: tuple[int, ...] = ()  # what the caller's init may hold besides their own
    init_caps: tuple[int, ...] = ()
    deadline_s: float = 300.0
    lock_key: tuple[str, int, int] | None = None  # ops._init_cwd_key
    image_bytes: int = 0

    @property
    def pid(self) -> int:
        return self.tree.pid


class CriuDump(StageBase):
    name = "dump"

    def __init__(self, criu: Criu, work: WorkDirs) -> None:
        self.criu = criu
        self.work = work

    def run(self, job: DumpJob) -> None:
        def still_ours(action: str, _pid: int | None) -> None:
            # The tree is dumped and still frozen. CRIU found it by pid; that pid is the held
            # root's only if the root is alive now (alive at authorization and now, it kept
            # its pid throughout). Otherwise CRIU resumes whatever it dumped, and nothing
            # of it is published.
            if action == "post-dump" and not job.tree.alive():
                raise RequestError("no_such_process",
                                   f"the tree of {job.pid} exited while it was being dumped")

        def tree_lives() -> None:
            # A PID namespace's init killed while CRIU holds its children deadlocks with CRIU
            # (the init waits for a traced zombie, CRIU for the init to trap): stop CRIU as
            # soon as the tree is going, rather than at its deadline.
            if not job.tree.alive() or _exiting(job.pid):
                raise RequestError("no_such_process",
                                   f"the tree of {job.pid} exited while it was being dumped")

        with self.criu.locks.hold(job.lock_key):
            if job.lock_key is not None:
                _, dev, ino = job.lock_key
                owner = job.tree.tree.owner  # whose inits' cwd (root may dump anyone's)
                if self.work.clear_parasite_dir(owner, (dev, ino)):
                    log.warning("uid=%d: removed a stale proc.crtools from its inits' cwd (an "
                                "init was killed while CRIU dumped it)", owner)
            for attempt in range(DUMP_TRIES):
                try:
                    self.criu.dump(job.pid, job.staging.fd, leave_running=job.leave_running,
                                   run_as=job.run_as, deadline_s=job.deadline_s,
                                   on_notify=still_ours, watch=tree_lives,
                                   externals=tree_socket_ids(job.pid))
                    return
                except CriuFailed as exc:
                    # a connection accepted after the sockets were listed, or dropped before
                    # the frozen kernel accepted it: CRIU resumed the tree; list them again and
                    # dump again
                    if attempt + 1 == DUMP_TRIES or not is_new_connection(str(exc)):
                        raise
                    log.info("pid %d: a connection came during the dump; dumping again", job.pid)
                    clear_dir(job.staging.fd)


def clear_dir(dir_fd: int) -> None:
    """Remove the files a failed CRIU run left in a staging dir (CRIU writes flat files)."""
    for entry in os.scandir(dir_fd):
        if not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.name, dir_fd=dir_fd)


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
            check_creds(self.criu, job.staging.fd, job.caller.uid, job.allowed_gids,
                        init_groups=job.init_groups, init_caps=job.init_caps)


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
    registry: Registry
    replace: Held | None = None
    run_as: RunAs | None = None
    init_groups: tuple[int, ...] = ()
    init_caps: tuple[int, ...] = ()
    min_deadline_s: float = 300.0
    pid: int | None = None
    staged: list[str] = field(default_factory=list)
    staged_bytes: int = 0
    linked: dict[str, int] = field(default_factory=dict)  # hard-linked page files: their sizes
    cgroup_procs: str | None = None  # the caller's cgroup: the restored tree goes there
    gpu_map: tuple[tuple[str, str], ...] = ()
    retarget: RetargetPlan = field(default_factory=RetargetPlan)  # see retarget.py
    retargeted: dict = field(default_factory=dict)
    replaced_exiting: bool = False  # killed, its exit not waited for (KillReplaced)
    park: bool = False  # set the replaced tree aside, alive (KillReplaced)
    lazy: bool = False  # leave private memory to a page daemon (lazy_pages.py)
    whole_why: str | None = None  # asked for lazy, restored whole: why
    stream: PageStream | None = None
    source: PageSource | None = None  # the page files come from the caller (page_source.py)

    @property
    def replace_pid(self) -> int | None:
        return self.replace.pid if self.replace is not None else None


def _copy_checked(src: int, dst_dir: int, name: str, expect: FileSeal | None,
                  owner: Caller) -> int:
    dst = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dst_dir,
    )
    try:
        os.fchown(dst, owner.uid, owner.gid)  # CRIU may read it as the caller
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
    return size


def _link_or_copy(src: int, dst_dir: int, name: str, owner: Caller) -> int:
    """Hard-link a page file into the staging dir (copy where links cannot cross); its size.

    A linked file is still the caller's own inode and could be truncated while CRIU reads it
    (which makes CRIU spin): the restore's watchdog checks the sizes while CRIU runs.
    """
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
            os.fchown(dst, owner.uid, owner.gid)
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
    return os.fstat(src).st_size


class StageImages(StageBase):
    """Bring the images into the staging dir, checked against their seal."""

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
        served: dict[str, int | None] = {}  # page files the source serves: their sealed sizes
        for name in names:
            if job.source is not None and name.startswith("pages-"):
                served[name] = seals[name].size if seals is not None else None
                continue
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
                if (seal is not None and seal.sha256 is None) or (
                        seal is None and name.startswith("pages-")):
                    # private memory (size suffices), or root's restore (no checks)
                    size = _link_or_copy(fd, job.staging.fd, name, job.caller)
                    job.linked[name] = size
                else:
                    size = _copy_checked(fd, job.staging.fd, name, seal, job.caller)
                job.staged_bytes += size
            finally:
                os.close(fd)
            job.staged.append(name)
        if job.lazy and images_map_cuda(self.criu, job.staging.fd):
            job.lazy, job.whole_why = False, GPU_RESTORED_WHOLE
        if job.source is not None:
            job.staged_bytes += job.source.fill(self.criu, job.staging.fd, job.caller,
                                                everything=not job.lazy)
            for name, size in served.items():  # a sealed page file: the size it was dumped at
                try:
                    now = os.stat(name, dir_fd=job.staging.fd, follow_symlinks=False).st_size
                except FileNotFoundError:
                    now = -1
                if size is not None and now != size:
                    raise untrusted(f"{name} differs in size from what was dumped")
        check_page_files(self.criu, job.staging.fd)  # before the kill stage: refuse early
        if not trusted:
            check_creds(self.criu, job.staging.fd, job.caller.uid, job.allowed_gids,
                        init_groups=job.init_groups, init_caps=job.init_caps)


class KillReplaced(StageBase):
    """End the tree the restore replaces, and wait for its exit (which frees every page of its
    memory: a quarter of a second for 3 GiB on two cores), except in a lazy restore of a tree
    in a PID namespace: nothing that tree holds is taken back by pid, so it is killed and
    exits beside CRIU's restore, at the lowest priority, its listeners shut down first
    (unix_peers.shut_accepted: the server's connections end at once, and the addresses can be
    bound again; a killed process runs no more code). ``job.replaced_exiting`` says so, and
    the op reaps it after the restore (ops.py). A whole restore keeps the wait: images that
    map the CUDA driver (restored whole) need the GPU memory the old tree frees."""

    name = "kill"

    def __init__(self, criu: Criu) -> None:
        self.criu = criu

    def run(self, job: RestoreJob) -> None:
        if job.park:
            park_replaced(self.criu, job)
            return
        if job.replace is None:
            return
        if job.lazy and job.replace.tree.namespace:
            members = member_pidfds(job.replace)
            try:
                # its connections go first: the server reconnects to the restored kernel
                # without waiting for the old one's exit (unix_peers.py)
                if shut_accepted({**members, job.replace.pid: job.replace.pidfd}):
                    nice_threads([job.replace.pid, *members])
                    kill_root(job.replace)
                    job.replaced_exiting = True
                    return
            finally:
                for fd in members.values():
                    os.close(fd)
        # (no listener found, or none could be shut down: the restore binds after the exit)
        terminate_tree(job.replace)


def park_replaced(criu: Criu, job: RestoreJob) -> None:
    """Set the replaced tree aside, alive and untouched but for the connections its listeners
    accepted, which are shut down (the server reconnects to the restored kernel; the caller
    has moved the listeners' socket files aside first). An undo restores beside the kernel it
    leaves and dumps that kernel afterwards. Refused, before anything is touched, where the
    restore needs what the tree holds: pids (no PID namespace) or GPU memory (either side
    maps the CUDA driver). Nothing is reniced: CRIU would save the priority with the tree."""
    replace = job.replace
    why = None
    if replace is None:
        why = "there is no kernel to set aside"
    elif not replace.tree.namespace:
        why = "the kernel has no PID namespace of its own (the restore takes its pids back)"
    elif job.whole_why == GPU_RESTORED_WHOLE or images_map_cuda(criu, job.staging.fd):
        why = "the snapshot holds GPU state"
    if why is None and replace is not None:
        members = member_pidfds(replace)
        try:
            if any(uses_nvidia(pid) for pid in [replace.pid, *members]):
                why = "the kernel uses the GPU"
            else:
                shut_connections({**members, replace.pid: replace.pidfd})
                return
        finally:
            for fd in members.values():
                os.close(fd)
    raise RequestError("cannot_park", f"the kernel cannot be set aside while the snapshot is "
                       f"restored: {why}")


class CriuRestore(StageBase):
    name = "restore"

    def __init__(self, criu: Criu) -> None:
        self.criu = criu

    def run(self, job: RestoreJob) -> None:
        stream = None
        if job.lazy:
            expect = processes_to_serve(self.criu, job.staging.fd)
            argv = self.criu.command(job.run_as)
            if job.run_as is not None:
                argv.append("--unprivileged")
            stream = job.stream = PageStream(argv, job.staging.fd, source=job.source)

        def on_notify(action: str, pid: int | None) -> None:
            # The restored tree exists, frozen, not yet running: record it now, so that a
            # helper that dies from here on still knows whose tree this is (registry.py).
            if action == "post-restore" and pid is not None:
                job.registry.add(pid, job.caller.uid)
                job.pid = pid
            if action == "post-restore" and stream is not None:
                stream.hold_uffds(expect)  # before it runs: see lazy_pages.py

        def pages_unchanged() -> None:
            for name, size in job.linked.items():
                try:
                    now = os.stat(name, dir_fd=job.staging.fd, follow_symlinks=False).st_size
                except FileNotFoundError:
                    now = -1
                if now != size:
                    raise untrusted(f"{name} changed while CRIU was reading it")

        def aborted() -> None:
            kill_aborted_restore(job.registry, job.pid)

        deadline = self.criu.deadline_s(job.staged_bytes)
        detached = detached_inodes(self.criu.messages(job.staging.fd, FILES_IMAGE, "FILES",
                                                      "file_entry"))
        started = time.clock_gettime(time.CLOCK_BOOTTIME)
        try:
            with closed_ends(detached) as inherit:
                pid = self.criu.restore(job.staging.fd, run_as=job.run_as,
                                        deadline_s=deadline, on_notify=on_notify,
                                        watch=pages_unchanged, on_abort=aborted,
                                        cgroup_procs=job.cgroup_procs, inherit=inherit,
                                        lazy=stream is not None)
        except RequestError as exc:
            end_failed_restore(job, {int(t["pid"]) for t in tree_tasks(
                self.criu, job.staging.fd)}, started)
            if stream is None:
                raise
            stream.abort()
            job.stream = None
            why = stream.source.error if stream.source is not None else None
            if why is None:
                raise
            # the daemon failed because its pages' source did: that is the reason to give
            raise RequestError(exc.reason, f"{why}; {exc.message}") from exc
        except BaseException:
            if stream is not None:
                stream.abort()
                job.stream = None
            raise
        if job.pid is None:  # no post-restore notification: record it now
            job.registry.add(pid, job.caller.uid)
        job.pid = pid
