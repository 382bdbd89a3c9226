"""Where a kernel listens: ZMQ ipc sockets in a directory only its owner can enter.

A TCP port on 127.0.0.1 can be connected to by every account of the machine (the IOPub channel
then hands over every output in clear), and bound by any of them whenever the kernel does not
hold it: while it is hibernated, or between the kill and CRIU's bind of a restore. Unix sockets
under a 0700 directory of the kernel's owner can be neither bound nor connected to by another
account, at any moment, and a restore never depends on a port being free.

Each kernel gets ``<base>/<kernel id>/``, and its five channels are ZMQ's ``ipc://<dir>/k-<n>``.
``<base>`` is short, since a socket path holds at most 107 bytes: ``$INFINIJUP_SOCKET_DIR``, or
``$XDG_RUNTIME_DIR/infinijup``, or ``/tmp/infinijup-<uid>``. A base or kernel directory that is
not a real directory of this user, closed to everyone else, is refused (another account may have
made it first, to catch the sockets); it is never repaired or followed.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from .errors import InfinijupError

BASE_ENV = "INFINIJUP_SOCKET_DIR"
PREFIX = "k"  # ZMQ ipc endpoints are <dir>/k-1 ... <dir>/k-5
MAX_SOCKET_PATH = 107


class UnsafeSocketDir(InfinijupError):
    http_status = 500
    reason = "unsafe_socket_dir"


def base_dir() -> Path:
    explicit = os.environ.get(BASE_ENV)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _is_private_dir(Path(runtime)):
        return Path(runtime) / "infinijup"
    return Path(f"/tmp/infinijup-{os.geteuid()}")


def _is_private_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO))


def _private_dir(path: Path) -> Path:
    """``path`` as a directory of this user's that no one else can enter, made if missing."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot make the kernel socket directory {path}: "
                              f"{exc.strerror}") from None
    if not _is_private_dir(path):
        raise UnsafeSocketDir(
            f"{path} is not a directory of this user closed to everyone else (another account "
            f"may have made it to catch kernel sockets): remove it, or set {BASE_ENV} to a "
            "private directory")
    return path


def kernel_dir(kernel_id: str) -> Path:
    return base_dir() / kernel_id


def prepare(kernel_id: str) -> str:
    """Make the kernel's directory (and its base) if missing, check both, and return the ZMQ
    ipc address prefix for the kernel's connection (its ``ip``)."""
    base = _private_dir(base_dir())
    path = _private_dir(base / kernel_id)
    ip = str(path / PREFIX)
    if len(f"{ip}-99".encode()) > MAX_SOCKET_PATH:
        raise UnsafeSocketDir(f"the kernel socket directory {path} is too long for a unix "
                              f"socket path: set {BASE_ENV} to a shorter one")
    return ip


def check(ip: str) -> None:
    """Before a kernel binds its endpoints again (a wake, a restore): its directory must still
    be this user's and private; made again if it went (a reboot cleared /tmp)."""
    path = Path(ip).parent
    _private_dir(path.parent)
    _private_dir(path)


def remove(kernel_id: str) -> None:
    """The kernel is over: its sockets go with its directory."""
    path = kernel_dir(kernel_id)
    if _is_private_dir(path):
        shutil.rmtree(path, ignore_errors=True)
