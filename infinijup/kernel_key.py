"""The HMAC key every Infinijup kernel of a user signs its messages with.

Jupyter gives each kernel a random key, and a kernel keeps it in memory: a snapshot restored
into another kernel session would sign with a key that session does not know. So all of a
user's Infinijup kernels share one key, made once and kept owner-only beside the default store
(``$INFINIJUP_KERNEL_KEY_FILE`` moves it). It guards the kernels' ports against other users
exactly as per-kernel keys do; the user's own processes could read each other's keys anyway.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

KEY_FILE_ENV = "INFINIJUP_KERNEL_KEY_FILE"


def key_file() -> Path:
    path = os.environ.get(KEY_FILE_ENV)
    if path:
        return Path(path)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "share")
    return Path(base) / "infinijup" / "kernel.key"


def user_kernel_key() -> bytes:
    """This user's kernel key, created (owner-only, atomically) on first use."""
    path = key_file()
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # first writer wins; a racing second one reads the winner's key
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _read(path)


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        key = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(key) < 32:
        raise ValueError(f"{path} holds no usable kernel key: remove it to make a new one")
    return key
