"""Work directories and path confinement.

The helper runs as root but acts on paths that callers name, inside directories those callers
own and can change at any moment. So a path is never trusted as a string: it is resolved, the
directory that holds it is opened, and the *opened* directory's real path (read back from
/proc/self/fd) is what is checked against the caller's work dir. Everything after that uses the
directory fd plus a single name with symlinks not followed.

Layout::

    <work>/            root 0711  (callers can reach their own dir, not list others)
    <work>/.staging/   root 0700  (CRIU writes and reads here, out of callers' reach)
    <work>/.seal-key   root 0600  (see seal.py)
    <work>/.nsinit/    root 0700  (cwd of every tree's root-owned init, see nsinit.py)
    <work>/<uid>/      uid  0700  (the caller's work dir)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from .proc import Caller
from .protocol import RequestError

STAGING = ".staging"
NSINIT_CWD = ".nsinit"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def bad_path(path: str, why: str) -> RequestError:
    return RequestError("bad_path", f"{path!r}: {why}")


def fd_path(fd: int) -> str:
    """Where an open fd really points now (" (deleted)" suffix and all)."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _inside(path: str, base: str, *, allow_equal: bool) -> bool:
    return (allow_equal and path == base) or path.startswith(base.rstrip("/") + "/")


@dataclass(frozen=True)
class Staging:
    """A fresh root-only directory under <work>/.staging, with an open fd to it."""

    path: str
    name: str
    fd: int


class WorkDirs:
    """The helper's work root and every caller's work dir under it."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.staging_root = os.path.join(self.root, STAGING)
        # CRIU's parasite briefly creates "proc.crtools" in a tree init's cwd: keep it private.
        self.nsinit_cwd = os.path.join(self.root, NSINIT_CWD)

    def prepare(self) -> None:
        """Create the root and staging dirs with their modes; refuse a root that is a symlink."""
        for path, mode in (
            (self.root, 0o711),
            (self.staging_root, 0o700),
            (self.nsinit_cwd, 0o700),
        ):
            os.makedirs(path, mode=mode, exist_ok=True)
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise RuntimeError(f"{path} is not a directory")
            os.chown(path, 0, 0, follow_symlinks=False)
            os.chmod(path, mode)
        # Leftovers of a helper that died mid-operation: nobody can be using them now.
        for entry in os.listdir(self.staging_root):
            shutil.rmtree(os.path.join(self.staging_root, entry), ignore_errors=True)

    def user_dir(self, caller: Caller) -> str:
        """``<work>/<uid>``, created 0700 and owned by the caller on first use."""
        path = os.path.join(self.root, str(caller.uid))
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise RequestError("helper_error", f"{path} is not a directory; remove it")
        if st.st_uid != caller.uid or stat.S_IMODE(st.st_mode) != 0o700:
            os.chown(path, caller.uid, caller.gid, follow_symlinks=False)
            os.chmod(path, 0o700, follow_symlinks=False)
        return path

    # --- confinement ------------------------------------------------------------------------

    def _check_syntax(self, path: str) -> None:
        if not os.path.isabs(path):
            raise bad_path(path, "must be an absolute path")
        if ".." in path.split("/"):
            raise bad_path(path, "must not contain '..'")

    def open_dir(self, caller: Caller, path: str) -> int:
        """Open an existing directory strictly inside the caller's work dir; return its fd."""
        self._check_syntax(path)
        base = self.user_dir(caller)
        try:
            fd = os.open(os.path.realpath(path), DIR_FLAGS)
        except FileNotFoundError:
            raise bad_path(path, "does not exist") from None
        except NotADirectoryError:
            raise bad_path(path, "is not a directory") from None
        except OSError as exc:
            raise bad_path(path, f"cannot be opened: {exc.strerror}") from None
        if not _inside(fd_path(fd), base, allow_equal=False):
            os.close(fd)
            raise bad_path(path, f"is not inside your work dir {base}")
        return fd

    def open_parent(self, caller: Caller, path: str) -> tuple[int, str]:
        """For a path that may not exist yet: an fd of its (verified) parent and its last name.

        The parent may be the work dir itself; the named entry is always strictly inside it.
        """
        self._check_syntax(path)
        stripped = path.rstrip("/")
        parent, name = os.path.split(stripped)
        if not name or name == ".":
            raise bad_path(path, "does not name an entry inside your work dir")
        base = self.user_dir(caller)
        try:
            fd = os.open(os.path.realpath(parent or "/"), DIR_FLAGS)
        except FileNotFoundError:
            raise bad_path(path, "its parent directory does not exist") from None
        except OSError as exc:
            raise bad_path(path, f"its parent directory cannot be opened: {exc.strerror}") from None
        if not _inside(fd_path(fd), base, allow_equal=True):
            os.close(fd)
            raise bad_path(path, f"is not inside your work dir {base}")
        return fd, name

    def confine_file(self, caller: Caller, path: str) -> str:
        """The resolved path of a (possibly new) file inside the work dir, for use by the
        caller's own processes (which the kernel holds to the caller's permissions)."""
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
            return os.path.join(fd_path(fd), name)
        finally:
            os.close(fd)

    # --- staging ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def staging(self, prefix: str) -> Iterator[Staging]:
        """A private directory for CRIU to work in, removed on exit unless renamed away."""
        path = tempfile.mkdtemp(prefix=prefix + "-", dir=self.staging_root)
        fd = os.open(path, DIR_FLAGS)
        try:
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
