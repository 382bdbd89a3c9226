"""ipykernel's subprocess pipe on the kernel's private directory instead of a TCP port.

ipykernel's IOPub thread listens on a random TCP port of 127.0.0.1 for the output of forked
subprocesses (multiprocessing). Any account can connect to that port, and any can bind it while
the kernel is hibernated, so that the wake fails. An Infinijup kernel listens on ipc endpoints
in a directory only its owner can enter (infinijup/endpoints.py): the pipe goes there too, as
``<ip>-pipe`` beside the five channels, and a restore into another session moves it with them
(engine/retarget.py, :func:`move`).
"""

from __future__ import annotations

import os

PIPE_SUFFIX = "-pipe"


def install(ip: str) -> None:
    import zmq
    from ipykernel import iostream
    from zmq.eventloop.zmqstream import ZMQStream

    def _setup_pipe_in(self) -> None:
        self._pipe_uuid = os.urandom(16)
        pipe_in = self.socket.context.socket(zmq.PULL)
        pipe_in.linger = 0
        self._pipe_address = f"ipc://{ip}{PIPE_SUFFIX}"
        pipe_in.bind(self._pipe_address)
        self._pipe_in = ZMQStream(pipe_in, self.io_loop)
        self._pipe_in.on_recv(self._handle_pipe_msg)

    def _setup_pipe_out(self):  # noqa: ANN202 - ipykernel's (context, socket)
        ctx = zmq.Context()  # a new one after fork
        pipe_out = ctx.socket(zmq.PUSH)
        pipe_out.linger = 3000
        pipe_out.connect(self._pipe_address)
        return ctx, pipe_out

    iostream.IOPubThread._setup_pipe_in = _setup_pipe_in
    iostream.IOPubThread._setup_pipe_out = _setup_pipe_out


def move(thread, ip: str) -> None:  # noqa: ANN001 - ipykernel's IOPubThread
    """After a restore into another session: subprocesses forked from now on reach the pipe
    at its new path (the helper already bound the listening socket there)."""
    if getattr(thread, "_pipe_address", None):
        thread._pipe_address = f"ipc://{ip}{PIPE_SUFFIX}"


def ip_of(argv: list[str]) -> str | None:
    """The ipc prefix of the connection file named by ``-f``, if the kernel uses ipc."""
    import json

    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "-f" and i + 1 < len(argv) else (
            arg[3:] if arg.startswith("-f=") else None)
        if path:
            try:
                with open(path) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                return None
            return info.get("ip") if info.get("transport") == "ipc" else None
    return None
