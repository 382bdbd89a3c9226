"""Process lifecycle: the one-instance guard, the pidfile, and ``--daemon``'s double fork.

The guard is an flock on ``<socket>.lock`` held for the helper's whole life, so two helpers
started at once cannot both bind; the socket answering, or the lock being held, both mean
"already running".
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import sys
from collections.abc import Callable

from .config import HelperConfig

Ready = Callable[[str | None], None]  # None: serving; else why it could not start


def socket_answers(path: str) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def read_pidfile(path: str | None) -> int | None:
    if not path:
        return None
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def acquire_instance_lock(config: HelperConfig) -> int | None:
    """The lock fd if this process is now the one helper for this socket, else None."""
    os.makedirs(os.path.dirname(config.lock_path) or ".", mode=0o755, exist_ok=True)
    # Never through a symlink someone planted, never someone else's file.
    fd = os.open(config.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise RuntimeError(f"{config.lock_path} is not a regular file of ours")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def running_instance(config: HelperConfig) -> str | None:
    """A description of the helper already serving this socket, or None."""
    if socket_answers(config.socket_path):
        return f"socket {config.socket_path} answers"
    fd = acquire_instance_lock(config)
    if fd is None:
        pid = read_pidfile(config.pidfile)
        return f"pid {pid}" if pid else f"{config.lock_path} is locked"
    os.close(fd)
    return None


def write_pidfile(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)


def remove_pidfile(path: str | None) -> None:
    if path and read_pidfile(path) == os.getpid():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def daemonize(config: HelperConfig, run: Callable[[HelperConfig, Ready], int]) -> int:
    """Double-fork, detach, and return (in the original process) once the helper serves.

    The foreground process waits on a pipe for "ready" so ``sudo make helper`` only returns
    when the socket accepts connections, and reports a start failure with its reason.
    """
    status_r, status_w = os.pipe()
    first = os.fork()
    if first:
        os.close(status_w)
        chunks = []
        while chunk := os.read(status_r, 4096):
            chunks.append(chunk)
        os.close(status_r)
        os.waitpid(first, 0)
        message = b"".join(chunks).decode(errors="replace")
        if message.startswith("ok "):
            print(f"infinijup helper started (pid {message[3:]}, socket {config.socket_path})")
            return 0
        if message.startswith("running "):
            print(f"infinijup helper already running ({message[8:]})")
            return 0
        print(f"infinijup helper failed to start: {message or 'no reason given'}", file=sys.stderr)
        return 1

    os.close(status_r)
    os.setsid()
    if os.fork():
        os._exit(0)
    os.chdir("/")
    os.umask(0o022)
    null = os.open(os.devnull, os.O_RDWR)
    out = (
        os.open(config.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        if config.log_path
        else null
    )
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)

    def ready(error: str | None) -> None:
        nonlocal status_w
        if status_w < 0:
            return
        os.write(status_w, (f"ok {os.getpid()}" if error is None else error).encode())
        os.close(status_w)
        status_w = -1

    code = 1
    try:
        code = run(config, ready)
    finally:
        ready("exited before it was ready")
        os._exit(code)
