"""Where things are: defaults, environment overrides, command-line values."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

DEFAULT_SOCKET = "/run/infinijup/helper.sock"
DEFAULT_WORK = "/var/lib/infinijup/work"
DEFAULT_CRIU = "/opt/infinijup/criu/sbin/criu"
DEFAULT_PYCRIU = "/opt/infinijup/criu/python"


def default_socket() -> str:
    return os.environ.get("INFINIJUP_HELPER_SOCKET") or DEFAULT_SOCKET


def default_work() -> str:
    return os.environ.get("INFINIJUP_HELPER_WORK") or DEFAULT_WORK


def default_criu() -> str | None:
    """env INFINIJUP_CRIU, else the project's own build, else ``criu`` on PATH."""
    explicit = os.environ.get("INFINIJUP_CRIU")
    if explicit:
        return explicit
    if os.access(DEFAULT_CRIU, os.X_OK):
        return DEFAULT_CRIU
    return shutil.which("criu")


def default_pycriu() -> str:
    return os.environ.get("INFINIJUP_PYCRIU") or DEFAULT_PYCRIU


@dataclass(frozen=True)
class HelperConfig:
    socket_path: str
    work_dir: str
    criu_binary: str
    pycriu_path: str
    daemon: bool = False
    pidfile: str | None = None
    log_path: str | None = None
    pid_namespace: bool | None = None  # None: decided by whether CUDA is usable

    @property
    def lock_path(self) -> str:
        """Held (flock) by the running helper for its whole life: the one-instance guard."""
        return self.socket_path + ".lock"
