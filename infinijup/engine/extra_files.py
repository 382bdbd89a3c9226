"""Files the kernel wrote while quiesced (its GPU segments, gpu_vmm.py), stored beside its
images: opened safely and held under a shared lock until stored, and copied into the hot tier
with their holes left holes."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from ..errors import SnapshotFailed


def open_extra(paths: dict[str, str]) -> dict[str, int]:
    """Open each file (never through a symlink, only one of this user), shared-locked."""
    out: dict[str, int] = {}
    try:
        for name, path in paths.items():
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            out[name] = fd
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise SnapshotFailed(f"snapshot failed: {path} is not a file of this user")
            fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        for fd in out.values():
            os.close(fd)
        raise SnapshotFailed(f"snapshot failed: the kernel's {exc.filename or 'file'} cannot "
                             f"be read: {exc.strerror}") from exc
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def data_ranges(fd: int):  # noqa: ANN202
    """(offset, length) of the data of a file, holes left out (SEEK_DATA / SEEK_HOLE)."""
    size = os.fstat(fd).st_size
    at = 0
    while at < size:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end - start
        at = end


def data_bytes(fd: int) -> int:
    return sum(n for _, n in data_ranges(fd))


def copy_sparse(fd: int, target: Path) -> None:
    """Copy the file open at ``fd`` to ``target`` (new, 0600), its holes left holes."""
    size = os.fstat(fd).st_size
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(out, size)
        for start, length in data_ranges(fd):
            done = 0
            while done < length:
                at, left = start + done, length - done
                try:
                    n = os.copy_file_range(fd, out, left, at, at)
                except OSError as exc:  # across filesystems (EXDEV), or not supported
                    if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS,
                                         errno.EOPNOTSUPP):
                        raise
                    n = os.pwrite(out, os.pread(fd, min(left, 8 << 20), at), at)
                if n == 0:
                    raise OSError(errno.EIO, f"short copy into {target}")
                done += n
    finally:
        os.close(out)
