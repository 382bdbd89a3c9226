"""Where things live and how long we wait: one place for Infinijup's defaults.

Each value can be overridden by an environment variable, so the server, the kernel magics, the
helper and the tests agree without passing configuration around.
"""

from __future__ import annotations

import os
from pathlib import Path

HELPER_SOCKET_ENV = "INFINIJUP_HELPER_SOCKET"
DEFAULT_HELPER_SOCKET = "/run/infinijup/helper.sock"

KERNEL_ID_ENV = "INFINIJUP_KERNEL_ID"
SERVER_URL_ENV = "INFINIJUP_SERVER_URL"
SERVER_TOKEN_ENV = "INFINIJUP_SERVER_TOKEN"
RESULTS_DIR_ENV = "INFINIJUP_RESULTS_DIR"


def helper_socket() -> str:
    """The unix socket of the privileged helper."""
    return os.environ.get(HELPER_SOCKET_ENV, DEFAULT_HELPER_SOCKET)


def results_dir() -> Path:
    """Where the server leaves the outcome of operations a kernel asked for itself.

    The kernel polls a file here instead of holding a connection open across its own dump: an
    open connection to a peer outside the kernel's tree would be stale in the snapshot.
    """
    base = os.environ.get(RESULTS_DIR_ENV)
    if base:
        return Path(base)
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "infinijup-results"
