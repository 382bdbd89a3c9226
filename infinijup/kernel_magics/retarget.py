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


def adopt(kernel_id: str, server_url: str | None = None, results_dir: str | None = None,
          connection_file: str | None = None) -> str:
    os.environ[config.KERNEL_ID_ENV] = kernel_id  # %snapshot names this kernel from now on
    # resumed by another server (a restart, another port): where to ask, where answers land
    if server_url:
        os.environ[config.SERVER_URL_ENV] = server_url
    if results_dir:
        os.environ[config.RESULTS_DIR_ENV] = results_dir
    if connection_file:  # %connect_info: this session's file (the old one may be elsewhere)
        from ipykernel.kernelapp import IPKernelApp

        if IPKernelApp.initialized():
            IPKernelApp.instance().connection_file = connection_file
    _read_host_anew()
    return json.dumps({"kernel_id": kernel_id})


def _read_host_anew() -> None:
    """The kernel may now run on another machine, whose name it must see: drop the name
    Python cached (``platform.node()``) and the one a container runtime put in the
    environment. ``socket.gethostname()`` asks the system each time."""
    platform._uname_cache = None  # type: ignore[attr-defined]
    if "HOSTNAME" in os.environ:
        os.environ["HOSTNAME"] = socket.gethostname()
