"""Where things are: defaults, environment overrides, command-line values."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field

from .limits import Limits

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


def trusted_by_everyone(path: str) -> bool:
    """Whether every user may run ``path`` and only root can change it: the file and every
    directory above it (symlinks resolved) root-owned, not group/other-writable, and
    reachable (x) by others."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        if st.st_uid != 0 or st.st_mode & 0o022 or not st.st_mode & 0o001:
            return False
        parent = os.path.dirname(real)
        while True:
            st = os.stat(parent)
            if st.st_uid != 0 or st.st_mode & 0o022 or not st.st_mode & 0o001:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:  # a directory on the way we cannot even look at
        return False


def default_nsinit_python() -> str:
    """The interpreter of every tree's init (run as the caller, so every user must be able to
    run it): env INFINIJUP_NSINIT_PYTHON, else the helper's own Python if it is installed where
    only root can change it and everyone can run it, else /usr/bin/python3."""
    explicit = os.environ.get("INFINIJUP_NSINIT_PYTHON")
    if explicit:
        return explicit
    if trusted_by_everyone(sys.executable):
        return sys.executable
    return "/usr/bin/python3"


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
    nsinit_python: str = "/usr/bin/python3"
    criu_timeout_s: float = 300.0
    cgroup: str = "caller"  # kernels join their caller's cgroup (v2): "caller" or "none"
    gpu_arena: str = "auto"  # a huge-page tmpfs for GPU segments: "auto", "always", "never"
    gpu_arena_quota: str = "75%"  # each user's arena tmpfs: bytes (k/m/g/t) or % of the RAM
    limits: Limits = field(default_factory=Limits)

    @property
    def lock_path(self) -> str:
        """Held (flock) by the running helper for its whole life: the one-instance guard."""
        return self.socket_path + ".lock"
