"""reconnect.py: after a kernel is replaced, only connections to the new kernel count, though
the old one may still be exiting (its accepted sockets carry the same path)."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile

from infinijup.engine.reconnect import connections_to, wait_reconnected


def _listen(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen()
    return sock


def test_connections_to_the_old_kernel_do_not_count_as_reconnected() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k-1")
        old = _listen(path)
        ours = socket.socket(socket.AF_UNIX)
        ours.connect(path)
        accepted_old, _ = old.accept()
        before = connections_to([path])
        assert len(before[path]) == 1

        # the old kernel is replaced but has not exited: its connection is still up, and a
        # new listener holds the path
        os.unlink(path)
        new = _listen(path)
        assert connections_to([path], before) == {path: set()}
        assert asyncio.run(wait_reconnected(before, 0.2)) >= 0.2  # not reconnected: timed out

        again = socket.socket(socket.AF_UNIX)
        again.connect(path)
        accepted_new, _ = new.accept()
        now = connections_to([path], before)
        assert len(now[path]) == 1 and not now[path] & before[path]
        assert asyncio.run(wait_reconnected(before, 30)) < 30
        for sock in (ours, again, accepted_old, accepted_new, old, new):
            sock.close()
