"""Reading a file that holds a kernel's key (its connection file), refusing one others can touch.

Each kernel session has a key of its own (Jupyter's, in its connection file); no key is shared
by a user's kernels, and none outlives its session except inside the snapshots of that kernel
(engine/retarget.py). A key file must be a regular file of this user, mode 0600 or stricter,
reached through directories no other account can write (a sticky directory such as /tmp
excepted): otherwise another account could read the key, or put its own in place.
"""

from __future__ import annotations

import os
import stat


class UnsafeKeyFile(PermissionError):
    """A key file (or a directory above it) that another account could read or replace."""


def read_private(path: str) -> bytes:
    """The content of the key file ``path``, after checking it and every directory above it."""
    uid = os.geteuid()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeKeyFile(f"{path} is not a regular file")
        if st.st_uid != uid:
            raise UnsafeKeyFile(f"{path} belongs to uid {st.st_uid}, not to this user ({uid})")
        if st.st_mode & 0o077:
            raise UnsafeKeyFile(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: a key file "
                                "must be readable by its owner only (chmod 600)")
        _check_parents(os.path.dirname(os.path.abspath(path)), uid)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check_parents(directory: str, uid: int) -> None:
    while True:
        st = os.lstat(directory)
        others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if st.st_uid not in (0, uid) or (others_write and not st.st_mode & stat.S_ISVTX):
            raise UnsafeKeyFile(f"{directory} can be changed by other accounts: a key file "
                                "below it could be replaced")
        parent = os.path.dirname(directory)
        if parent == directory:
            return
        directory = parent
