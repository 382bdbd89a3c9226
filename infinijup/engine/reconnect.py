"""Has this process reconnected to a restored kernel?

When a kernel is replaced by a restored one, every ZMQ socket this server holds towards it (the
notebooks' websockets, the activity monitor) sees its TCP connection drop and reconnects on its
own, every 100 ms. Messages a kernel publishes before a SUB socket is back are lost to it, so a
restore is not finished until this process holds as many established connections to each of
the kernel's ports as it did before. We count them in /proc/net/tcp, by socket inode.
"""

from __future__ import annotations

import asyncio
import os
import time

_ESTABLISHED = "01"


def _own_socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def connections_to(ports: list[int]) -> dict[int, int]:
    """How many established TCP connections this process has to each of ``ports``."""
    counts = {p: 0 for p in ports}
    own = _own_socket_inodes()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] != _ESTABLISHED or fields[9] not in own:
                        continue
                    port = int(fields[2].rsplit(":", 1)[1], 16)
                    if port in counts:
                        counts[port] += 1
        except OSError:
            continue
    return counts


async def wait_reconnected(before: dict[int, int], timeout: float) -> float:
    """Wait until this process is connected to each port at least as often as ``before``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        now = connections_to(list(before))
        if all(now[p] >= n for p, n in before.items()):
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    return time.monotonic() - t0
