"""A kernel's unix socket connections to processes outside its tree, across a dump and restore.

Kernels listen on ZMQ ipc endpoints (unix sockets in a directory only their owner can enter), so
the Jupyter server's connections to a kernel are unix stream sockets whose other end is outside
the dumped tree. CRIU refuses to dump half of such a connection unless the socket is named as an
external one; on restore it needs a socket to put in its place. The connection itself cannot
come back (its peer is the server's socket of that moment), so the restored kernel gets a socket
whose other end is already closed: ZMQ reads end-of-file, drops that connection, and the server
reconnects to the restored listener, as it does after a kernel restart. That is what CRIU's
``tcp_close`` does for TCP connections.

- dump: every socket inode the tree holds is named ``unix[INO]`` in CRIU's external list (an
  inode whose peer is inside the tree is not affected by it). A connection accepted between
  this walk and CRIU's freeze is not in the list: CRIU then fails with "External socket is
  used", resumes the tree, and the dump is tried again (``is_new_connection``).
- restore: each unix socket of the images whose peer is an external one gets the live end of a
  fresh socket pair whose other end is closed, through CRIU's ``inherit_fd``.
- a restore in place: the replaced kernel's listeners and the connections they accepted are
  shut down as it is killed (``shut_accepted``), so that the server reconnects to the restored
  listener as soon as it listens, not after the old kernel's exit has freed all its memory
  (Linux closes a process's files last).
- an undo's restore beside the kernel it leaves: that kernel's accepted connections are shut
  down, its listeners kept (``shut_connections``); it is dumped afterwards, as it was.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator

from .proc import pidfd_getfd, tree_members

USK_EXTERN = 1  # CRIU's sk-unix.c: a socket outside the dumped tree
_SOCKET = re.compile(r"^socket:\[(\d+)\]$")
NEW_CONNECTION = "External socket is used"  # CRIU's message for an unlisted external peer
# ... and for a connection a listener had not accepted when the tree was frozen, whose client
# has gone since (CRIU cannot tell what it sent)
DROPPED_CONNECTION = "Found a closed in-flight socket"
MAX_EXTERNAL = 4096


def tree_socket_ids(root: int) -> list[str]:
    """CRIU's external ids (``unix[INO]``) of every socket a process of the tree holds."""
    inodes: set[int] = set()
    for pid in tree_members(root):
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for name in names:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            match = _SOCKET.match(target)
            if match:
                inodes.add(int(match.group(1)))
    return [f"unix[{ino}]" for ino in sorted(inodes)[:MAX_EXTERNAL]]


def is_new_connection(message: str) -> bool:
    """Whether a failed dump failed on a connection made after the sockets were listed, or
    made and dropped while the tree was frozen (once thawed, the kernel accepts it): a dump
    tried again succeeds."""
    return NEW_CONNECTION in message or DROPPED_CONNECTION in message


def detached_inodes(files: list) -> list[int]:
    """Inodes of the image's unix sockets whose peer was outside the dumped tree; ``files``:
    files.img's entries as protobuf messages (criu.py's ``messages``)."""
    entries = [e.usk for e in files if e.HasField("usk")]
    external = {u.ino for u in entries if u.uflags & USK_EXTERN}
    return sorted(u.ino for u in entries
                  if not u.uflags & USK_EXTERN and u.HasField("peer") and u.peer in external)


@contextlib.contextmanager
def closed_ends(inodes: list[int]) -> Iterator[list[tuple[str, int]]]:
    """``(inherit key, fd)`` for each inode: one end of a pair whose other end is closed. The
    descriptors are closed again when the restore is over (CRIU holds its own copies)."""
    ends: list[socket.socket] = []
    try:
        for _ in inodes:
            live, gone = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            gone.close()
            ends.append(live)
        yield [(f"socket:[{ino}]", end.fileno()) for ino, end in zip(inodes, ends, strict=True)]
    finally:
        for end in ends:
            end.close()


_STREAM_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)


def _stream_sockets(pidfds: dict[int, int]) -> list[socket.socket]:
    """A copy of every unix or TCP stream socket the processes hold (pid -> pidfd, each taken while
    it was a member of the tree: checkpoint.member_pidfds)."""
    out: list[socket.socket] = []
    seen: set[int] = set()
    for pid, pidfd in pidfds.items():
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                match = _SOCKET.match(os.readlink(f"/proc/{pid}/fd/{name}"))
                if match is None or int(match.group(1)) in seen:
                    continue
                fd = pidfd_getfd(pidfd, int(name))
            except (OSError, ValueError):
                continue  # closed meanwhile, or the process has exited
            try:
                copy = socket.socket(fileno=fd)
            except OSError:
                os.close(fd)  # the descriptor was reused meanwhile, by something else
                continue
            if os.fstat(copy.fileno()).st_ino != int(match.group(1)):
                copy.close()  # the descriptor was reused meanwhile: not the socket listed
                continue
            seen.add(int(match.group(1)))
            if copy.family in _STREAM_FAMILIES and copy.type == socket.SOCK_STREAM:
                out.append(copy)
            else:
                copy.close()
    return out


def shut_accepted(pidfds: dict[int, int]) -> int:
    """Shut down, both ways, the listening sockets of these processes (a kernel tree about to
    be killed: its ZMQ endpoints) and every connection they accepted (the server's): the
    server sees its connections end now, not once the old kernel's exit has freed all its
    memory, and its reconnects are refused (a listener shut down takes no connection) until
    the restored kernel listens, so they never reach the old kernel. A socket accepted on a
    listener carries the listener's own address, which is how its connections are told from
    others. Unix sockets (the server's ipc endpoints) and TCP (a kernel on ports). Returns
    how many listeners were shut down."""
    return _shut(pidfds, listeners=True)[0]


def shut_connections(pidfds: dict[int, int]) -> int:
    """Shut down, both ways, every connection the listening sockets of these processes
    accepted, and no listener (a kernel set aside by an undo: it is dumped later, listening
    as it did). Returns how many were shut down."""
    return _shut(pidfds, listeners=False)[1]


def _shut(pidfds: dict[int, int], listeners: bool) -> tuple[int, int]:
    """(listeners, connections) shut down: see shut_accepted."""
    socks = _stream_sockets(pidfds)
    try:
        listening = {_name(s) for s in socks if _listens(s)}
        listening.discard(None)
        shut = [0, 0]
        for s in socks:
            if _name(s) not in listening:
                continue
            listener = _listens(s)  # (a TCP listener shut down listens no more)
            if listener and not listeners:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue
            shut[0 if listener else 1] += 1
        return shut[0], shut[1]
    finally:
        for s in socks:
            s.close()


def _listens(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


def _name(sock: socket.socket) -> tuple | None:
    """The socket's own address (None: unnamed, or none)."""
    try:
        name = sock.getsockname()
    except OSError:
        return None
    if not name:
        return None
    return (sock.family, name if isinstance(name, (str, bytes)) else tuple(name))
