"""Work directories and path confinement, through descriptors.

The helper runs as root but acts on paths that callers name, inside directories those callers
own and can change at any moment, in mount namespaces of their own. So a path is never
resolved as a string by root and then trusted: it must *name* something inside the caller's
work dir (``<work>/<uid>/...``, checked on the string as given), and what follows that prefix
is resolved with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_XDEV)`` from a descriptor of the work dir that the helper opened itself. No
symlink, no magic link (``/proc/PID/root`` of a process in another mount namespace), no
mount point and no ``..`` is crossed, whatever happens to the tree meanwhile. Everything after
that uses the directory fd plus a single name, symlinks not followed.

Layout::

    <work>/                  root 0711  (callers can reach their own dir, not list others)
    <work>/.staging/         root 0700  (CRIU writes and reads here, out of callers' reach)
    <work>/.staging/<op>-*   the caller 0700 (CRIU runs as the caller, see creds.py)
    <work>/.seal-key         root 0600  (see seal.py)
    <work>/.nsinit/          root 0711
    <work>/.nsinit/nsinit.py root 0644  (the launcher and init every tree runs, see nsinit.py)
    <work>/.nsinit/<uid>/    root:infinijup-nsinit 0775 (cwd of that uid's tree inits: CRIU's
                             parasite creates its /proc mount point there during a dump)
    <work>/<uid>/            uid  0700  (the caller's work dir)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from .lazy_pages import end_waiting_daemon
from .proc import Caller
from .protocol import RequestError

log = logging.getLogger(__name__)

STAGING = ".staging"
NSINIT_DIR = ".nsinit"
NSINIT_SCRIPT = "nsinit.py"
PARASITE_PROC_DIR = "proc.crtools"  # CRIU's parasite's mount point in a namespace init's cwd
MNT_DETACH = 2
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_CONFINED = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_SYS_OPENAT2 = 437
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2); raises OSError like os.open."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _umount_detached(path: str) -> None:
    """umount2(path, MNT_DETACH); ``path`` may be a /proc/self/fd link to the mount's root."""
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)


def bad_path(path: str, why: str) -> RequestError:
    return RequestError("bad_path", f"{path!r}: {why}")


def _open_error(path: str, exc: OSError, what: str) -> RequestError:
    if exc.errno == errno.ENOENT:
        return bad_path(path, f"{what} does not exist")
    if exc.errno == errno.ENOTDIR:
        return bad_path(path, f"{what} is not a directory")
    if exc.errno == errno.ELOOP:
        return bad_path(path, f"{what} goes through a symlink (not allowed)")
    if exc.errno == errno.EXDEV:
        return bad_path(path, f"{what} leaves your work dir (a mount point, a magic link or "
                              "an absolute symlink)")
    return bad_path(path, f"{what} cannot be opened: {exc.strerror}")


@dataclass(frozen=True)
class Staging:
    """A fresh directory under <work>/.staging (only reachable through ``fd``)."""

    path: str
    name: str
    fd: int


class WorkDirs:
    """The helper's work root and every caller's work dir under it."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.staging_root = os.path.join(self.root, STAGING)
        self.nsinit_root = os.path.join(self.root, NSINIT_DIR)
        self.nsinit_path = os.path.join(self.nsinit_root, NSINIT_SCRIPT)
        self._root_fd = -1

    def prepare(self, nsinit_source: str) -> None:
        """Create the root, staging and nsinit dirs with their modes; refuse a root that is a
        symlink; put a fresh copy of nsinit.py where every user can run it."""
        for path, mode in (
            (self.root, 0o711),
            (self.staging_root, 0o700),
            (self.nsinit_root, 0o711),
        ):
            os.makedirs(path, mode=mode, exist_ok=True)
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise RuntimeError(f"{path} is not a directory")
            os.chown(path, 0, 0, follow_symlinks=False)
            os.chmod(path, mode, follow_symlinks=False)
        self._root_fd = os.open(self.root, DIR_FLAGS)
        # Leftovers of a helper that died mid-operation: nobody can be using them now but a
        # page daemon, serving an adopted tree (it holds what it reads open) or waiting for a
        # restore that will never come, which is told to give up.
        staging_fd = os.open(self.staging_root, DIR_FLAGS)
        try:
            for entry in os.listdir(staging_fd):
                with contextlib.suppress(OSError):
                    fd = os.open(entry, DIR_FLAGS, dir_fd=staging_fd)
                    try:
                        if end_waiting_daemon(fd):
                            log.info("a page daemon waited in %s for a restore that never "
                                     "came: told to give up", entry)
                    finally:
                        os.close(fd)
                shutil.rmtree(entry, dir_fd=staging_fd, ignore_errors=True)
        finally:
            os.close(staging_fd)
        with open(nsinit_source, "rb") as f:
            script = f.read()
        nsinit_fd = os.open(self.nsinit_root, DIR_FLAGS)
        try:
            tmp = f".{NSINIT_SCRIPT}.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=nsinit_fd)
            with os.fdopen(fd, "wb") as f:
                f.write(script)
                os.fchmod(f.fileno(), 0o644)
            os.rename(tmp, NSINIT_SCRIPT, src_dir_fd=nsinit_fd, dst_dir_fd=nsinit_fd)
        finally:
            os.close(nsinit_fd)

    def nsinit_cwd(self, uid: int, group: int | None) -> str:
        """``<work>/.nsinit/<uid>``: root:``group`` 0775 (root 0755 without a group)."""
        name = str(uid)
        parent = os.open(self.nsinit_root, DIR_FLAGS)
        try:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
            try:
                mode = 0o775 if group is not None else 0o755
                os.fchown(fd, 0, group if group is not None else 0)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        finally:
            os.close(parent)
        return os.path.join(self.nsinit_root, name)

    def clear_parasite_dir(self, uid: int, cwd_id: tuple[int, int]) -> bool:
        """Remove a stale ``proc.crtools`` from ``<work>/.nsinit/<uid>`` (whose (st_dev, st_ino)
        must be ``cwd_id``, the dumped init's cwd); True if there was one.

        Dumping a PID namespace's init, CRIU's parasite makes that directory in the init's
        cwd, mounts a proc on it, detaches the mount and removes the directory. An init killed
        in between (its owner may kill it mid-dump) leaves the directory, or the mount too,
        behind, and every later dump of that uid's trees fails ("Can't create a directory
        (-17)"). Dumps of trees sharing a cwd are serialized (criu.py), so one found while the
        caller holds that lock is stale."""
        parent = os.open(self.nsinit_root, DIR_FLAGS)
        try:
            try:
                cwd_fd = os.open(str(uid), DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                return False
        finally:
            os.close(parent)
        try:
            st = os.fstat(cwd_fd)
            if (st.st_dev, st.st_ino) != cwd_id:
                return False  # not the init's cwd: leave it alone
            try:
                entry = os.stat(PARASITE_PROC_DIR, dir_fd=cwd_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if not stat.S_ISDIR(entry.st_mode):
                os.unlink(PARASITE_PROC_DIR, dir_fd=cwd_fd)
                return True
            fd = os.open(PARASITE_PROC_DIR, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW |
                         os.O_CLOEXEC, dir_fd=cwd_fd)
            try:
                if os.fstat(fd).st_dev != st.st_dev:  # the proc mount was left on it too
                    _umount_detached(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            # The directory is the init's (the parasite made it as the init), so its owner
            # may have put files in it: remove them without following any link
            shutil.rmtree(PARASITE_PROC_DIR, dir_fd=cwd_fd)
            return True
        finally:
            os.close(cwd_fd)

    def user_dir(self, caller: Caller) -> str:
        """``<work>/<uid>``, created 0700 and owned by the caller on first use."""
        fd = self._user_dir_fd(caller)
        os.close(fd)
        return os.path.join(self.root, str(caller.uid))

    def _user_dir_fd(self, caller: Caller) -> int:
        name = str(caller.uid)
        try:
            os.mkdir(name, 0o700, dir_fd=self._root_fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=self._root_fd)
        except OSError:
            raise RequestError("helper_error", f"{self.root}/{name} is not a directory; "
                                               "remove it") from None
        st = os.fstat(fd)
        if st.st_uid != caller.uid or stat.S_IMODE(st.st_mode) != 0o700:
            os.fchown(fd, caller.uid, caller.gid)
            os.fchmod(fd, 0o700)
        return fd

    # --- confinement ------------------------------------------------------------------------

    def _relative(self, caller: Caller, path: str) -> str:
        """What follows ``<work>/<uid>/`` in ``path`` (may be empty), or bad_path."""
        if not os.path.isabs(path):
            raise bad_path(path, "must be an absolute path")
        parts = path.split("/")
        if ".." in parts:
            raise bad_path(path, "must not contain '..'")
        base = os.path.join(self.root, str(caller.uid))
        stripped = path.rstrip("/")
        if stripped == base:
            return ""
        if not stripped.startswith(base + "/"):
            raise bad_path(path, f"is not inside your work dir {base}")
        return stripped[len(base) + 1:]

    def open_dir(self, caller: Caller, path: str) -> int:
        """Open an existing directory strictly inside the caller's work dir; return its fd."""
        rel = self._relative(caller, path)
        if not rel:
            raise bad_path(path, "must be inside your work dir, not the work dir itself")
        base = self._user_dir_fd(caller)
        try:
            return openat2(base, rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                           RESOLVE_CONFINED)
        except OSError as exc:
            raise _open_error(path, exc, "it") from None
        finally:
            os.close(base)

    def open_parent(self, caller: Caller, path: str) -> tuple[int, str]:
        """For a path that may not exist yet: an fd of its parent and its last name.

        The parent may be the work dir itself; the named entry is always strictly inside it.
        """
        rel = self._relative(caller, path)
        if not rel:
            raise bad_path(path, "does not name an entry inside your work dir")
        parent, name = os.path.split(rel)
        if not name or name == ".":
            raise bad_path(path, "does not name an entry inside your work dir")
        base = self._user_dir_fd(caller)
        if not parent:
            return base, name
        try:
            return openat2(base, parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                           RESOLVE_CONFINED), name
        except OSError as exc:
            raise _open_error(path, exc, "its parent directory") from None
        finally:
            os.close(base)

    def confine_file(self, caller: Caller, path: str) -> str:
        """The path of a (possibly new) file inside the work dir, for use by the caller's own
        processes (which open it with the caller's permissions, symlinks not followed)."""
        fd, name = self.open_parent(caller, path)
        try:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise bad_path(path, "is a symlink")
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise bad_path(path, "is a directory")
            return path.rstrip("/")
        finally:
            os.close(fd)

    # --- staging ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def staging(self, prefix: str, owner: Caller | None = None) -> Iterator[Staging]:
        """A private directory for CRIU to work in, removed on exit unless renamed away.

        Owned by ``owner`` when CRIU runs as the caller; its parent (root 0700) keeps everyone
        but the helper from reaching it by path, the owner included.
        """
        path = tempfile.mkdtemp(prefix=prefix + "-", dir=self.staging_root)
        fd = os.open(path, DIR_FLAGS)
        try:
            if owner is not None and not owner.is_root:
                os.fchown(fd, owner.uid, owner.gid)
            yield Staging(path=path, name=os.path.basename(path), fd=fd)
        finally:
            os.close(fd)
            shutil.rmtree(path, ignore_errors=True)

    def publish(self, staging: Staging, parent_fd: int, name: str, caller: Caller) -> None:
        """Hand a finished staging dir to the caller: chown everything, rename it into place.

        The rename is atomic, so ``images_dir`` either does not appear or appears complete.
        """
        chown_flat_dir(staging.fd, caller.uid, caller.gid)
        staging_root_fd = os.open(self.staging_root, DIR_FLAGS)
        try:
            os.rename(staging.name, name, src_dir_fd=staging_root_fd, dst_dir_fd=parent_fd)
        except OSError as exc:
            raise bad_path(name, f"cannot be created: {exc.strerror}") from None
        finally:
            os.close(staging_root_fd)


def check_target_free(parent_fd: int, name: str, path: str) -> None:
    """A dump target must be absent or an empty directory (never a symlink)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise bad_path(path, "exists and is not a directory")
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.listdir(fd):
            raise bad_path(path, "must be empty")
    finally:
        os.close(fd)


def chown_flat_dir(dir_fd: int, uid: int, gid: int) -> None:
    """Give a directory of image files to the caller: files 0600, the dir 0700.

    Images hold process memory, so nobody but their owner may read them.
    """
    for entry in os.scandir(dir_fd):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
        else:
            os.chown(entry.name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
    os.fchown(dir_fd, uid, gid)
    os.fchmod(dir_fd, 0o700)


def remove_entry(parent_fd: int, name: str) -> bool:
    """Remove a file, symlink or directory tree below ``parent_fd`` without following links.

    Returns False when there was nothing to remove.
    """
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent_fd)  # fd-based: immune to symlink swaps
    else:
        os.unlink(name, dir_fd=parent_fd)
    return True
