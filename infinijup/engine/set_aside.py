"""A kernel set aside by an undo: alive beside the restored kernel until it is dumped.

An undo of a kernel changed since its last snapshot keeps the state it leaves, so that a redo
can come back to it. Dumping and storing that state first made the user wait for both (an
undo took 14x a restore). Instead the kernel is set aside: its listening socket files are
renamed within its owner-only endpoint directory (the sockets keep listening, unreachable by
name), the helper shuts down the connections they accepted and restores the snapshot beside it,
binding the kernel's endpoints anew; the kernel set aside is then dumped and stored behind the
restored one, and ended (serverext/undo.py).

CRIU records a unix socket's address as it was bound, not where its file is now, so the dump
of the kernel set aside records its own endpoints, and a redo restores it onto them. Were the
files removed instead, CRIU would see the sockets' files as deleted and restore them without an
address.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..process import TrackedProcess

_PREFIX = ".aside-"


def move_aside(paths: list[str], tag: str) -> list[tuple[str, str]]:
    """Rename each socket file of ``paths`` (those there) to ``.aside-<tag>-<name>`` in its
    directory: (path, where it went) pairs. Undone by :func:`move_back` if any rename fails."""
    moved: list[tuple[str, str]] = []
    try:
        for path in paths:
            directory, name = os.path.split(path)
            try:
                if not stat.S_ISSOCK(os.lstat(path).st_mode):
                    continue
            except FileNotFoundError:
                continue
            aside = os.path.join(directory, f"{_PREFIX}{tag}-{name}")
            os.rename(path, aside)
            moved.append((path, aside))
    except BaseException:
        move_back(moved)
        raise
    return moved


def move_back(moved: list[tuple[str, str]]) -> None:
    """Give the sockets their names back (over whatever a failed restore bound there)."""
    for path, aside in moved:
        try:
            os.replace(aside, path)
        except FileNotFoundError:
            pass


def remove(moved: list[tuple[str, str]]) -> None:
    for _path, aside in moved:
        try:
            os.unlink(aside)
        except FileNotFoundError:
            pass


@dataclass
class SetAside:
    """The kernel an undo left: its process (held by a pidfd) and its socket files."""

    process: TrackedProcess
    moved: list[tuple[str, str]]

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        """Its socket files go, and the handle on its process (the tree itself is ended by
        the helper's dump, or by whoever gives up on it)."""
        remove(self.moved)
        self.process.close()
