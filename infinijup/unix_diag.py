"""The machine's unix sockets, with their names and peers (the kernel's sock_diag, as ``ss -x``).

/proc/net/unix names a socket but not its peer; a server counting its connections to a kernel's
ipc endpoints needs both: its own socket's peer is the kernel's accepted socket, which carries
the endpoint's path.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_NAME, UDIAG_SHOW_PEER = 0x1, 0x4
UNIX_DIAG_NAME, UNIX_DIAG_PEER = 0, 2
TCP_ESTABLISHED, TCP_LISTEN = 1, 10
_HDR = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBHIIIII")
_MSG = struct.Struct("=BBBBIII")
_ATTR = struct.Struct("=HH")


@dataclass(frozen=True)
class UnixSocket:
    inode: int
    state: int
    name: str  # "" when unnamed
    peer: int  # 0 when none


def unix_sockets() -> dict[int, UnixSocket]:
    """Every unix socket of this network namespace, by inode."""
    req = _REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_PEER, 0, 0)
    out: dict[int, UnixSocket] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.send(_HDR.pack(_HDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                          NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        while True:
            data = nl.recv(1 << 16)
            off = 0
            while off + _HDR.size <= len(data):
                length, kind, _flags, _seq, _pid = _HDR.unpack_from(data, off)
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR or length < _HDR.size:
                    raise OSError("sock_diag refused the unix socket dump")
                sock = _parse(data[off + _HDR.size: off + length])
                out[sock.inode] = sock
                off += (length + 3) & ~3


def _parse(body: bytes) -> UnixSocket:
    _family, _type, state, _pad, inode, _c0, _c1 = _MSG.unpack_from(body, 0)
    name, peer = "", 0
    off = _MSG.size
    while off + _ATTR.size <= len(body):
        length, kind = _ATTR.unpack_from(body, off)
        if length < _ATTR.size:
            break
        value = body[off + _ATTR.size: off + length]
        if kind == UNIX_DIAG_NAME:
            name = value.split(b"\0", 1)[0].decode(errors="replace") if value[:1] != b"\0" else ""
        elif kind == UNIX_DIAG_PEER and len(value) >= 4:
            peer = struct.unpack_from("=I", value)[0]
        off += (length + 3) & ~3
    return UnixSocket(inode, state, name, peer)


def own_socket_inodes(pid: str | int = "self") -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes
