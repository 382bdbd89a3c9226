"""The GPU arena: a tmpfs with huge pages where kernels put their GPU segments (issue 13).

A kernel's first snapshot writes its PyTorch GPU memory into a new file of its arena, and the
page allocations of that file bound the way out: about 4.5 GB/s with the 4 KiB pages of
/dev/shm on the GPU hosts, 24 GB/s with 2 MiB pages (``bench/arena_pages_probe.py``). Pinning
the file for the copy, and freeing it, are faster too. Only root can mount a tmpfs with
``huge=within_size``, so the helper does, beside its socket::

    <socket dir>/gpu-arena/          tmpfs, root 0711, huge=within_size, half the RAM at most
    <socket dir>/gpu-arena/<uid>/    uid 0700 (created by ``hello``; the server's arena root)

The mount outlives the helper (kernels keep their files there across a helper restart); a
helper that finds it mounted takes it as it is. Where the mount fails (no CAP_SYS_ADMIN, a
container), there is no helper arena and servers keep theirs in /dev/shm.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat

from .proc import Caller

log = logging.getLogger(__name__)

NAME = "gpu-arena"
TMPFS_MAGIC = 0x01021994
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPTIONS = b"huge=within_size,size=50%,mode=0711,uid=0,gid=0"
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def _is_tmpfs_mount(path: str) -> bool:
    buf = _StatFs()
    if _libc.statfs(path.encode(), ctypes.byref(buf)) != 0:
        return False
    parent = os.stat(os.path.dirname(path))
    return buf.f_type == TMPFS_MAGIC and os.stat(path).st_dev != parent.st_dev


def mount(socket_path: str) -> str | None:
    """The arena beside the socket (mounted now, or already), or None where it cannot be."""
    path = os.path.join(os.path.dirname(os.path.abspath(socket_path)), NAME)
    try:
        os.mkdir(path, 0o711)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is not a directory")
    if _is_tmpfs_mount(path):
        return path
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, OPTIONS) != 0:
        err = ctypes.get_errno()
        log.warning("no GPU arena: cannot mount a tmpfs with huge pages at %s: %s", path,
                    os.strerror(err))
        return None
    return path


def user_dir(root: str, caller: Caller) -> str:
    """``<root>/<uid>``: created 0700 and owned by the caller, through descriptors."""
    root_fd = os.open(root, DIR_FLAGS)
    try:
        name = str(caller.uid)
        try:
            os.mkdir(name, 0o700, dir_fd=root_fd)
        except FileExistsError:
            pass
        fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
        try:
            st = os.fstat(fd)
            if st.st_uid != caller.uid or stat.S_IMODE(st.st_mode) != 0o700:
                os.fchown(fd, caller.uid, caller.gid)
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)
    return os.path.join(root, name)
