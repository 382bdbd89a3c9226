"""Where a kernel's GPU segments wait while it is dumped (issue 13): its arena.

A private directory of the user in RAM, with one file per kernel: ``<root>/<kernel id>/segments``.
The root is ``INFINIJUP_GPU_ARENA_ROOT`` where set; else the user's own tmpfs with huge pages
that the helper mounts beside its socket (``<helper socket dir>/gpu-arena/<uid>``, mounted by
the helper's ``hello``, ``--gpu-arena-quota`` in size, nosuid,nodev,noexec: a first snapshot's
pages are allocated five times faster there); else ``/dev/shm/infinijup-<uid>``. The
kernel writes it while quiesced (``kernel_magics/gpu_vmm.py``), the store takes it in beside
the CRIU images as ``gpu-segments``, and the kernel reads it back when it resumes. It is kept
between snapshots (a file whose pages exist takes the next snapshot at copy-engine speed) and
removed when the kernel ends or hibernates (:func:`remove_kernel`). In the helper's arena the
helper removes them too, where a server died first (``infinijup_helper/arena.py``): a kernel's
directory when its tree ends, all of them when the user's last tree ends or at a helper start
that finds none running; the ``go-`` files stay (their writer removes them).

``INFINIJUP_GPU_ALLOCATOR=driver`` in the server's environment turns all of this off: every
snapshot then takes the CUDA driver's checkpoint of the whole GPU memory, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

ROOT_ENV = "INFINIJUP_GPU_ARENA_ROOT"  # the server's setting, and what kernels are told
ALLOCATOR_ENV = "INFINIJUP_GPU_ALLOCATOR"  # "vmm" (default) or "driver"
IMAGE_NAME = "gpu-segments"  # the file's name in a commit's tree
SEGMENTS = "segments"
HELPER_ARENA = "gpu-arena"  # the helper's mount beside its socket (infinijup_helper/arena.py)


def enabled() -> bool:
    return os.environ.get(ALLOCATOR_ENV, "vmm") != "driver"


def root() -> Path | None:
    """The user's arena root (not created); None when switched off or there is no tmpfs."""
    if not enabled():
        return None
    configured = os.environ.get(ROOT_ENV)
    if configured:
        return Path(configured)
    helper = helper_root()
    if _own_private_dir(helper):
        return helper
    return Path(f"/dev/shm/infinijup-{os.geteuid()}") if os.path.isdir("/dev/shm") else None


def helper_root() -> Path:
    """This user's tmpfs in the helper's GPU arena (theirs once the helper's hello mounted it;
    until then a directory of root's, which :func:`root` passes over)."""
    from .. import config

    return Path(os.path.dirname(config.helper_socket())) / HELPER_ARENA / str(os.geteuid())


def _own_private_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def prepare_root() -> Path | None:
    """Create the root (0700) and check it is this user's own directory, not a link or a
    directory another user made first in a world-writable /dev/shm. None: no arena."""
    path = root()
    if path is None:
        return None
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    return path if _own_private_dir(path) else None


def segments_path(kernel_id: str) -> str | None:
    base = root()
    if base is None or not kernel_id or "/" in kernel_id or kernel_id.startswith("."):
        return None
    return str(base / kernel_id / SEGMENTS)


def remove_kernel(kernel_id: str) -> None:
    """The kernel ended (or hibernated): its arena goes."""
    path = segments_path(kernel_id)
    if path is not None:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def set_aside(images: Path) -> str | None:
    """A restore's checked-out segments, moved beside the images (which the restore removes)
    for the kernel's resume to read; ``discard`` them after."""
    src = images / IMAGE_NAME
    if not src.is_file():
        return None
    dst = images.parent / f"{images.name}.{IMAGE_NAME}"
    os.replace(src, dst)
    return str(dst)


def discard(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def go_path(root_dir: str, token: str) -> str:
    """The file that tells a kernel its snapshot's dump is over (see kernel_magics/gpu_vmm)."""
    if not token or not all(c in "0123456789abcdef" for c in token):
        raise ValueError("not a snapshot token")
    return os.path.join(root_dir, f"go-{token}")


def say_go(token: str, source: str | None = None) -> None:
    """The dump of the snapshot ``token`` is over (``source`` None: the kernel takes its
    segments back from its arena), or a restore of it is under way (``source``: the copy of
    its segments to take)."""
    base = root()
    if base is None:
        return
    path = go_path(str(base), token)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"source": source}, f)
    os.replace(tmp, path)


def forget_go(token: str) -> None:
    base = root()
    if base is not None:
        try:
            os.unlink(go_path(str(base), token))
        except (FileNotFoundError, ValueError):
            pass
