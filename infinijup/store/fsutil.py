"""Durable, private file-system helpers: atomic writes and owner-only permissions.

Snapshot images hold process memory and secrets, so every directory the store creates is
0700 and every file 0600 regardless of the caller's umask (which can only remove bits).
"""

from __future__ import annotations

import ctypes
import os
import secrets
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Create ``path`` (and missing parents inside the store) with mode 0700."""
    p = Path(path)
    if p.is_dir():
        return
    if not p.parent.exists():
        make_private_dir(p.parent)
    try:
        os.mkdir(p, DIR_MODE)  # the umask can only remove bits from 0700
    except FileExistsError:
        pass


def temp_name(directory: Path, stem: str) -> Path:
    """A fresh, unguessable temp path inside ``directory``."""
    return directory / f".{stem}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """os.open with mode 0600 (only applied when the file is created)."""
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)


def atomic_write(path: Path, data: bytes, *, tmp_dir: Path | None = None) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync dir."""
    directory = path.parent
    make_private_dir(directory)
    tmp = temp_name(tmp_dir or directory, path.name)
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    fsync_dir(directory)


def unlink_durable(path: Path) -> bool:
    """Remove ``path`` and fsync its directory. Returns False if it did not exist."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _libc_sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk now
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; asynchronous, no flush, no durability
    promise). A later fsync then finds little left to do, and the disk works while we go on
    computing instead of all at the end. A no-op where the call is unavailable."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
