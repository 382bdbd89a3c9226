"""Has this process reconnected to a restored kernel?

When a kernel is replaced by a restored one, every ZMQ socket this server holds towards it (the
notebooks' websockets, the activity monitor) sees its connection drop and reconnects on its
own, every 100 ms. Messages a kernel publishes before a SUB socket is back are lost to it, so a
restore is not finished until this process holds as many connections to each of the kernel's
endpoints (unix socket paths, endpoints.py) as it did before: our sockets whose peer is a
socket bound to that path (sock_diag, unix_diag.py), and not one of the sockets it was connected
to before (a replaced kernel may still be exiting: helper's KillReplaced).
"""

from __future__ import annotations

import asyncio
import time

from ..unix_diag import TCP_ESTABLISHED, own_socket_inodes, unix_sockets


def connections_to(paths: list[str], old: dict[str, set[int]] | None = None
                   ) -> dict[str, set[int]]:
    """This process's connections to each of the unix socket ``paths``: the inodes of their
    peers, leaving out those in ``old`` (a replaced kernel that has not exited yet: the
    sockets it accepted carry its listener's path too)."""
    gone = set().union(*old.values()) if old else set()
    peers: dict[str, set[int]] = {p: set() for p in paths}
    try:
        sockets = unix_sockets()
    except OSError:
        return peers
    for inode in own_socket_inodes():
        mine = sockets.get(inode)
        peer = sockets.get(mine.peer) if mine is not None and mine.peer else None
        if (peer is not None and mine.state == TCP_ESTABLISHED and peer.name in peers
                and peer.inode not in gone):
            peers[peer.name].add(peer.inode)
    return peers


async def wait_reconnected(before: dict[str, set[int]], timeout: float,
                           also_gone: dict[str, set[int]] | None = None) -> float:
    """Wait until this process has as many connections to each path as ``before`` had, none
    of them to the sockets ``before`` (or ``also_gone``) saw."""
    t0 = time.monotonic()
    gone = {p: set(n) | set((also_gone or {}).get(p, ())) for p, n in before.items()}
    while time.monotonic() - t0 < timeout:
        now = await asyncio.to_thread(connections_to, list(before), gone)
        if all(len(now[p]) >= len(n) for p, n in before.items()):
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    return time.monotonic() - t0
