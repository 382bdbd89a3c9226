"""The GPU arena: tmpfs with huge pages where kernels put their GPU segments (issues 13, 26).

A kernel's first snapshot writes its PyTorch GPU memory into a new file of its arena, and the
page allocations of that file bound the way out: about 4.5 GB/s with the 4 KiB pages of
/dev/shm on the GPU hosts, 24 GB/s with 2 MiB pages (``bench/arena_pages_probe.py``). Pinning
the file for the copy, and freeing it, are faster too. Only root can mount a tmpfs with
``huge=within_size``, so the helper does, beside its socket, one tmpfs per user::

    <socket dir>/gpu-arena/          tmpfs, root 0711, nosuid,nodev,noexec: mount points only
    <socket dir>/gpu-arena/<uid>/    that user's own tmpfs (made by ``hello``): uid 0700,
                                     size=--gpu-arena-quota, huge=within_size,
                                     nosuid,nodev,noexec; the server's arena root

Each user's mount is its own pool: one user filling theirs gets ENOSPC, and nobody else
notices. ``hello`` mounts it over a directory the helper made itself (root's, 0700, inside
the root mount, which only root can write), through a descriptor of that directory, then the
mount's root belongs to the user: no user can make, swap or link the directory beforehand.

What is in a user's arena (``infinijup/gpu/arena.py``): ``<kernel id>/segments`` per kernel,
and a snapshot's ``go-<token>`` files while it is under way. The user's server removes a
kernel's directory when the kernel ends; the helper removes them too, because a server can
die first:

* when a tree ends and it was the last of its owner's trees, every kernel directory of that
  user goes (nothing of theirs runs that could need one); go files stay (a server may be
  waking a hibernated kernel, which has no tree yet, and removes its own);
* when a tree the helper spawned with ``INFINIJUP_KERNEL_ID`` in its environment ends, that
  kernel's directory goes, as long as every other live tree of the user is one the helper
  knows the kernel id of, and none has that id (a restored tree takes its kernel id from the
  server after the restore: the helper never learns it, and keeps what it cannot tell apart);
* at helper start: a user with no live tree in the registry has every kernel directory
  removed; a uid without an account (no passwd entry) and no live tree loses its mount
  altogether; anything in the root that is not a user's mount (the one shared tmpfs of
  issue 13's helpers, a mount point left by a reboot) is removed, and ``hello`` makes the
  mount anew. A user with live trees keeps their directories (the helper cannot tell which of
  them their kernels still answer to): they go when that user's last tree ends.

The mounts outlive the helper (kernels keep their files across a helper restart). Where the
root cannot be mounted (no CAP_SYS_ADMIN, a container), there is no helper arena and servers
keep theirs in /dev/shm.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import pwd
import re
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .proc import Caller

log = logging.getLogger(__name__)

NAME = "gpu-arena"
TMPFS_MAGIC = 0x01021994
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x2, 0x4, 0x8, 0x20
MNT_DETACH = 0x2
SAFE_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC  # on every arena mount
# The root holds only the users' mount points. huge=within_size here too: a kernel without
# huge pages for tmpfs refuses the option, and then there is no arena at all (as before).
ROOT_OPTIONS = b"size=1m,nr_inodes=65536,mode=0711,uid=0,gid=0,huge=within_size"
USER_INODES = 4096  # a user's arena holds a directory and a file per kernel, and go files
DEFAULT_QUOTA = "75%"  # of the RAM, per user: a switch of a 56 and a 24 GB kernel on a 128 GiB host
# needs both out at once (docs/benchmarks.md); the driver's path would pin the same host memory
KERNEL_ID_ENV = "INFINIJUP_KERNEL_ID"  # infinijup/config.py's: the kernel's id, in spawn's env
GO_PREFIX = "go-"  # infinijup/gpu/arena.py's go files, kept while the user lives
_QUOTA = re.compile(r"(?:[1-9][0-9]*[kKmMgGtT]?|(?:[1-9][0-9]?|100)%)")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


class _Tree(Protocol):  # registry.Tree, as far as the arena looks at it
    pid: int
    start: int
    owner: int

    def alive(self) -> bool: ...


def parse_quota(text: str) -> str:
    """``--gpu-arena-quota``: bytes (a k/m/g/t suffix allowed) or a percentage of the RAM,
    as tmpfs takes it for ``size=``. Never 0, which tmpfs reads as unlimited."""
    if not _QUOTA.fullmatch(text):
        raise ValueError(f"{text!r}: expected a size in bytes (k, m, g or t suffix allowed, "
                         "not 0) or a percentage of the RAM (1% to 100%)")
    return text


def _fs_type(fd: int) -> int | None:
    buf = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        return None
    return buf.f_type


def _fd_path(fd: int) -> bytes:
    """A path naming exactly what ``fd`` is open on (the kernel follows this link to the open
    file itself, never through a name someone could change meanwhile)."""
    return f"/proc/self/fd/{fd}".encode()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_tmpfs(fd: int, options: bytes) -> None:
    _check(_libc.mount(b"tmpfs", _fd_path(fd), b"tmpfs", SAFE_FLAGS, options), "mount")


def _remount(fd: int, options: bytes | None) -> None:
    """``fd``: a mount's root. Its flags become nosuid,nodev,noexec; ``options`` change."""
    _check(_libc.mount(None, _fd_path(fd), None, MS_REMOUNT | SAFE_FLAGS, options), "remount")


def _detach(fd: int) -> None:
    _check(_libc.umount2(_fd_path(fd), MNT_DETACH), "umount")


def _is_mount_root(fd: int, parent_fd: int) -> bool:
    return os.fstat(fd).st_dev != os.fstat(parent_fd).st_dev


@contextlib.contextmanager
def _opened(name: str, dir_fd: int | None = None) -> Iterator[int]:
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _account_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _kernel_name(kernel_id: object) -> str | None:
    """A kernel id that names one entry of an arena (as infinijup/gpu/arena.py accepts it)."""
    if (not isinstance(kernel_id, str) or not kernel_id or "/" in kernel_id or "\0" in kernel_id
            or kernel_id.startswith(".") or len(kernel_id.encode()) > 255):
        return None
    return kernel_id


def _open_dir(dir_fd: int, name: str, dev: int) -> int | None:
    """``name`` below ``dir_fd`` opened if it is a directory of the file system ``dev`` (None:
    it is something else, or gone). Never through a symlink, never another directory than
    the one looked at (a user may rename things in their arena meanwhile)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    got = os.fstat(fd)
    if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino) or got.st_dev != dev:
        os.close(fd)
        raise OSError(errno.ESTALE, f"{name} changed while it was being removed")
    return fd


def _remove_entry(dir_fd: int, name: str) -> None:
    """Remove ``name`` below ``dir_fd``: a file, or a whole directory tree (depth first,
    through descriptors, never out of the file system of ``dir_fd``)."""
    dev = os.fstat(dir_fd).st_dev
    fd = _open_dir(dir_fd, name, dev)
    if fd is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return
    stack = [(dir_fd, name, fd, os.listdir(fd))]  # (parent, name, its descriptor, names left)
    try:
        while stack:
            parent, entry, fd, left = stack[-1]
            if left:
                child = left.pop()
                sub = _open_dir(fd, child, dev)
                if sub is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(child, dir_fd=fd)
                else:
                    stack.append((fd, child, sub, []))
                    stack[-1][3].extend(os.listdir(sub))
                continue
            stack.pop()
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(entry, dir_fd=parent)
    finally:
        for _parent, _entry, fd, _left in stack:
            os.close(fd)


def _clear(user_fd: int, keep_go: bool = True) -> list[str]:
    """Empty a user's arena (its go files stay, with ``keep_go``). Returns what went."""
    removed = []
    for name in os.listdir(user_fd):
        if keep_go and name.startswith(GO_PREFIX):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(name, dir_fd=user_fd).st_mode):
                    continue
        try:
            _remove_entry(user_fd, name)
        except OSError as exc:
            log.warning("arena: cannot remove %s: %s", name, exc)
            continue
        removed.append(name)
    return removed


class Arena:
    """The mounted root beside the socket, and the users' mounts in it."""

    def __init__(self, root: str, quota: str = DEFAULT_QUOTA) -> None:
        self.root = root
        self.quota = parse_quota(quota)
        self._lock = threading.Lock()  # mounts, sweeps, the kernel ids below
        self._kernels: dict[tuple[int, int], str] = {}  # (pid, start) of a tree -> kernel id

    @classmethod
    def mount(cls, socket_path: str, quota: str = DEFAULT_QUOTA) -> Arena | None:
        """The arena beside the socket (its root mounted now, or already), or None where it
        cannot be. A root found mounted (by an earlier helper) is made nosuid,nodev,noexec."""
        socket_dir = os.path.dirname(os.path.abspath(socket_path))
        path = os.path.join(socket_dir, NAME)
        with _opened(socket_dir) as parent_fd:  # root's, writable by nobody else (bind())
            try:
                os.mkdir(NAME, 0o711, dir_fd=parent_fd)
            except FileExistsError:
                pass
            with _opened(NAME, parent_fd) as fd:
                st = os.fstat(fd)
                if st.st_uid != 0:
                    raise RuntimeError(f"{path} is not root's")
                try:
                    if not _is_mount_root(fd, parent_fd):
                        _mount_tmpfs(fd, ROOT_OPTIONS)
                    elif _fs_type(fd) != TMPFS_MAGIC:
                        raise OSError(errno.EINVAL, "a mount point, not of a tmpfs")
                    else:
                        _remount(fd, None)
                except OSError as exc:
                    log.warning("no GPU arena: cannot mount a tmpfs with huge pages at %s: %s",
                                path, exc.strerror)
                    return None
            with _opened(NAME, parent_fd) as fd:  # the mount's root, now
                os.fchown(fd, 0, 0)
                os.fchmod(fd, 0o711)
        return cls(path, quota)

    def _user_options(self, uid: int, gid: int) -> bytes:
        return (f"size={self.quota},nr_inodes={USER_INODES},huge=within_size,mode=0700,"
                f"uid={uid},gid={gid}").encode()

    # --- hello ---------------------------------------------------------------------------------

    def user_dir(self, caller: Caller) -> str:
        """``<root>/<uid>``: the caller's own tmpfs (mounted now, or already), 0700, theirs."""
        name = str(caller.uid)
        with self._lock, _opened(self.root) as root_fd:
            try:
                os.mkdir(name, 0o700, dir_fd=root_fd)  # root's: the mount point
            except FileExistsError:
                pass
            with _opened(name, root_fd) as fd:
                if not _is_mount_root(fd, root_fd):
                    st = os.fstat(fd)
                    if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
                        raise RuntimeError(f"{self.root}/{name} is not root's own directory")
                    _mount_tmpfs(fd, self._user_options(caller.uid, caller.gid))
            with _opened(name, root_fd) as fd:
                if not _is_mount_root(fd, root_fd):
                    raise RuntimeError(f"nothing is mounted at {self.root}/{name}")
                st = os.fstat(fd)
                if st.st_uid != caller.uid or stat.S_IMODE(st.st_mode) != 0o700:
                    os.fchown(fd, caller.uid, caller.gid)
                    os.fchmod(fd, 0o700)
        return os.path.join(self.root, name)

    # --- kernels ending -----------------------------------------------------------------------

    def spawned(self, tree: _Tree, env: Mapping[str, str]) -> None:
        """The helper spawned ``tree`` with this environment: remember its kernel id."""
        kernel = _kernel_name(env.get(KERNEL_ID_ENV))
        if kernel is None:
            return
        key = (tree.pid, tree.start)
        with self._lock:
            self._kernels[key] = kernel
        if not tree.alive():  # it may have ended (and been seen to) before it was recorded
            with self._lock:
                self._kernels.pop(key, None)

    def tree_ended(self, tree: _Tree, live: Iterable[_Tree]) -> None:
        """``tree`` ended; ``live``: its owner's live trees now. Idempotent."""
        key = (tree.pid, tree.start)
        with self._lock:
            kernel = self._kernels.pop(key, None)
            others = [(t.pid, t.start) for t in live if (t.pid, t.start) != key]
            if not others:
                self._clear_user(tree.owner, "its last tree ended")
            elif kernel is not None and all(self._kernels.get(k) not in (None, kernel)
                                            for k in others):
                self._remove_kernel(tree.owner, kernel)

    def _user_fd(self, root_fd: int, uid: int) -> int | None:
        """A descriptor of the user's mount's root, or None where it is not mounted."""
        try:
            fd = os.open(str(uid), DIR_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            return None
        if not _is_mount_root(fd, root_fd):
            os.close(fd)
            return None
        return fd

    def _clear_user(self, uid: int, why: str) -> None:
        with _opened(self.root) as root_fd:
            fd = self._user_fd(root_fd, uid)
            if fd is None:
                return
            try:
                removed = _clear(fd)
            finally:
                os.close(fd)
        if removed:
            log.info("arena of uid %d emptied (%s): %s", uid, why, ", ".join(sorted(removed)))

    def _remove_kernel(self, uid: int, kernel: str) -> None:
        with _opened(self.root) as root_fd:
            fd = self._user_fd(root_fd, uid)
            if fd is None:
                return
            try:
                if kernel not in os.listdir(fd):
                    return
                _remove_entry(fd, kernel)
            finally:
                os.close(fd)
        log.info("arena of uid %d: kernel %s ended, its files removed", uid, kernel)

    # --- helper start -------------------------------------------------------------------------

    def sweep(self, live_owners: Iterable[int]) -> None:
        """At start, with the uids that have live trees (the registry, once loaded)."""
        live = set(live_owners)
        with self._lock, _opened(self.root) as root_fd:
            for name in os.listdir(root_fd):
                try:
                    self._sweep_entry(root_fd, name, live)
                except OSError as exc:
                    log.warning("arena: cannot tidy %s/%s: %s", self.root, name, exc)

    def _sweep_entry(self, root_fd: int, name: str, live: set[int]) -> None:
        uid = int(name) if name.isdigit() and str(int(name)) == name else None
        st = os.lstat(name, dir_fd=root_fd)
        if uid is not None and stat.S_ISDIR(st.st_mode):
            with _opened(name, root_fd) as fd:
                if _is_mount_root(fd, root_fd):
                    if uid in live or _account_exists(uid):
                        if uid not in live:
                            removed = _clear(fd)
                            if removed:
                                log.info("arena of uid %d emptied (none of its kernels runs): "
                                         "%s", uid, ", ".join(sorted(removed)))
                        try:
                            _remount(fd, f"size={self.quota}".encode())  # this start's quota
                        except OSError as exc:
                            log.warning("arena of uid %d keeps its size: %s", uid, exc.strerror)
                        return
                    _clear(fd, keep_go=False)  # its pages go now, whoever holds the mount
                    _detach(fd)
                    log.info("arena of uid %d removed: no such account", uid)
        # not a user's mount: a mount point left by a reboot, or the directory of a user in
        # the one shared tmpfs of issue 13's helpers; hello mounts one anew
        _remove_entry(root_fd, name)
