"""Kernel side of restoring into another session (see infinijup/engine/retarget.py).

Called by the server right after such a restore, as a silent user expression: it touches only
Infinijup's own variable, none of the user's objects, no execution count, no output.
"""

from __future__ import annotations

import json
import os
import platform
import socket

from .. import config
from ..kernel_key import read_private


def adopt(kernel_id: str, server_url: str | None = None, results_dir: str | None = None,
          connection_file: str | None = None, ip: str | None = None,
          rekey: bool = False) -> str:
    os.environ[config.KERNEL_ID_ENV] = kernel_id  # %snapshot names this kernel from now on
    # resumed by another server (a restart, another port): where to ask, where answers land
    if server_url:
        os.environ[config.SERVER_URL_ENV] = server_url
    if results_dir:
        os.environ[config.RESULTS_DIR_ENV] = results_dir
    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance() if IPKernelApp.initialized() else None
    if connection_file and app is not None:  # %connect_info: this session's file
        app.connection_file = connection_file
    if ip and app is not None:
        # Its endpoints now live under this session's directory: the sockets ipykernel
        # removes when it exits are these, never those of the kernel it was copied from.
        app.ip = ip
        from .ipc_pipe import move

        move(getattr(app, "iopub_thread", None), ip)
    if rekey and connection_file:
        # This session's key (the file is its owner's alone): the server reads this reply,
        # and signs all that follows, with it; the key of the snapshot opens nothing now.
        key = json.loads(read_private(connection_file))["key"].encode()
        session = app.session if app is not None else None
        kernel = getattr(app, "kernel", None)
        for s in {id(x): x for x in (session, getattr(kernel, "session", None)) if x}.values():
            s.key = key
    _read_host_anew()
    return json.dumps({"kernel_id": kernel_id})


def _read_host_anew() -> None:
    """The kernel may now run on another machine, whose name it must see: drop the name
    Python cached (``platform.node()``) and the one a container runtime put in the
    environment. ``socket.gethostname()`` asks the system each time."""
    platform._uname_cache = None  # type: ignore[attr-defined]
    if "HOSTNAME" in os.environ:
        os.environ["HOSTNAME"] = socket.gethostname()
