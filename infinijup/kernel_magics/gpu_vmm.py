"""PyTorch's GPU memory past the driver floor (issue 13), inside the kernel.

At kernel start, :func:`arm` makes the first CUDA initialization of PyTorch put this thread's
allocations on Infinijup's VMM allocator (``infinijup/gpu/vmm.py``). Nothing imports torch or
touches CUDA before the user does.

A snapshot's quiesce then moves the allocator's segments into a file of the kernel's arena
(tmpfs; :func:`offload`) and frees their GPU memory: the driver checkpoint and CRIU see only a
small CUDA context, and the store takes the file in as it is. The resume maps the segments
back at their addresses and fills them from that file, or, after a restore, from the copy the
server checked out (:func:`bring_back`), but only once the server has said that the dump is
over (a "go" file per snapshot): a cell that runs between the quiesce and the dump, or a
process dumped in that moment, never reads an arena that a later snapshot rewrote. Where the allocator is not in place (torch imported
before the kernel started, CUDA initialized before, another allocator, no library), snapshots
take the driver path, as before, and the quiesce answer says why once.

The server writes ``INFINIJUP_GPU_ARENA_ROOT`` (a private tmpfs directory of the user) into
the kernel's environment; without it all of this stays off. The arena is
``<root>/<kernel id>/segments``: a resumed kernel, told its new id, writes its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
import uuid

from ..gpu.arena import ROOT_ENV as ARENA_ROOT_ENV
from ..gpu.arena import SEGMENTS
from .after_import import after_import

GO_TIMEOUT_S = 600.0
_state: dict = {"armed": False, "installed": False, "why_not": None, "told": False,
                "in_file": None, "token": None,
                "go": None,  # the server's word for the token, kept until the wake succeeds
                # the blocks' hashes of the last snapshot, the arena file they describe, that
                # snapshot's token and the file's holes then (what the next may leave unread)
                "hashes": None, "hashed_file": None, "file_token": None, "holes": None}


def _forget_file() -> None:
    """The arena file is not (or no longer) what the last snapshot's hashes describe."""
    _state["hashes"] = _state["hashed_file"] = _state["file_token"] = _state["holes"] = None


def arena_path() -> str | None:
    from .. import config

    root, kernel = os.environ.get(ARENA_ROOT_ENV), os.environ.get(config.KERNEL_ID_ENV)
    if not root or not kernel or "/" in kernel or kernel.startswith("."):
        return None
    return os.path.join(root, kernel, SEGMENTS)


def arm() -> None:
    """Install the allocator when PyTorch first initializes CUDA (call at kernel start)."""
    if _state["armed"] or arena_path() is None:
        return
    _state["armed"] = True
    from ..gpu import vmm  # now, not at the first snapshot (sys.modules is the user's to see)

    if not os.path.exists(vmm.library_path()):
        _state["why_not"] = f"the VMM allocator library is not built ({vmm.library_path()})"
        return
    after_import("torch", _queue)  # at once if torch is imported already, else once it is


def _queue(torch) -> None:  # noqa: ANN001
    try:
        if torch.cuda.is_initialized():
            _state["why_not"] = "CUDA was initialized before the kernel could install the allocator"
            return
        torch.cuda._lazy_call(_install)
    except Exception as exc:
        _state["why_not"] = f"cannot hook PyTorch's CUDA initialization: {exc}"


def _install() -> None:
    try:
        from ..gpu import vmm

        vmm.install()  # every device PyTorch sees: a model split over cards moves whole
        _state["installed"] = True
        vmm.set_on_short(_ask_for_room)
    except Exception as exc:
        _state["why_not"] = f"the VMM allocator could not be installed: {exc}"


def _ask_for_room(nbytes: int, device: int) -> bool:
    """The allocator found no room for ``nbytes`` on ``device``: ask the server to make room
    by releasing idle kernels (issue 27; never a busy one). True once it says there is room;
    else the reason goes to the cell's stderr and PyTorch raises its out-of-memory error."""
    from .server_client import ServerError, kernel_id, request

    try:
        try:
            import torch

            gpu = str(torch.cuda.get_device_properties(device).uuid)
        except Exception:  # an older PyTorch: the server knows the GPU if there is one
            gpu = str(device)
        request("POST", "/infinijup/make-room",
                {"kernel_id": kernel_id(), "bytes": int(nbytes), "gpu": gpu}, timeout=900)
        return True
    except ServerError as err:
        print(f"Infinijup could not make room on the GPU: {err}", file=sys.stderr)
        return False


def offload() -> dict | None:
    """Quiesce step: the segments into the arena file. Returns what to tell the server
    (``{"bytes", "segments", "segment_bytes", "seconds", "token"}``), ``{"fallback": why}``
    once when the driver path is taken, or None when there is nothing to say."""
    if not _state["installed"]:
        return _fallback_once()
    from ..gpu import vmm

    if vmm.stats()["on_gpu"] == 0:
        return None
    path = arena_path()
    if path is None:
        return None
    t0 = time.perf_counter()
    hashes, before, changed_s = None, _state["hashes"], None
    since, holes_before, hashed_file = _state["file_token"], _state["holes"], _state["hashed_file"]
    _forget_file()  # until this snapshot's are in the file
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        # The server reads the file of the previous snapshot under a shared lock until it is
        # stored: a second snapshot waits here for that, never overwrites it.
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            short = _arena_short(lock, os.path.dirname(path), vmm.stats()["on_gpu"])
            if short is not None:  # the driver path takes it: never a SIGBUS in the kernel
                return {"fallback": short}
            identity = _identity(lock)
            if identity != hashed_file:
                before = None  # another file: nothing in it can be skipped
            copy, hashes, changed_s = _changed(vmm, before)
            vmm.set_copy(copy if before is not None else None)
            moved = vmm.sleep_into(path)
            holes, in_file = _file_changes(lock, hashes, before, holes_before)
        finally:
            os.close(lock)
    except Exception as exc:
        # whatever moved comes back now; the driver path takes the whole GPU state
        try:
            vmm.wake_from(path)
        except Exception:
            pass
        return {"fallback": f"the segments could not be moved into {path}: {exc}"}
    _state["in_file"], _state["token"], _state["go"] = path, uuid.uuid4().hex, None
    _state["hashes"], _state["hashed_file"] = hashes, identity
    if hashes is not None:
        _state["file_token"], _state["holes"] = _state["token"], holes
    stats = vmm.stats()
    out = {"bytes": moved, "segments": stats["segments"], "segment_bytes": stats["bytes"],
           "seconds": round(time.perf_counter() - t0, 3), "token": _state["token"]}
    if since is not None and in_file is not None:
        # the file differs from the one of snapshot ``since`` only in these (offset, length)
        out["file_changes"] = {"since": since, "changed": in_file}
    if changed_s is not None:
        out["hash_s"] = round(changed_s, 3)
    out.update(vmm.timings())
    return out


def _arena_short(fd: int, directory: str, need: int) -> str | None:
    """Why the arena cannot take ``need`` more bytes now (None: it can). The arena is a tmpfs
    with a quota (the helper's ``--gpu-arena-quota``), and its file is written through a
    shared mapping: a page past the quota would kill the kernel with SIGBUS, so the room is
    looked at first (the pages the file already has count as room)."""
    fs = os.statvfs(directory)
    room = fs.f_bavail * fs.f_frsize + os.fstat(fd).st_blocks * 512
    if need <= room:
        return None
    return (f"the GPU arena has {room / 1e9:.1f} GB of room, the segments need "
            f"{need / 1e9:.1f} GB")


def _file_changes(fd: int, hashes: dict | None, before: dict | None,
                  holes_before: list | None) -> tuple[list | None, list | None]:
    """The file's holes now, and where it may differ from the last snapshot's (None: it may
    differ anywhere, or it is not known how it was)."""
    from ..gpu import file_changes

    try:
        holes = file_changes.holes(fd)
    except OSError:
        return None, None
    if hashes is None or before is None or holes_before is None:
        return holes, None
    size = os.fstat(fd).st_size
    return holes, file_changes.changed(size, file_changes.kept_blocks(hashes, before),
                                       holes_before, holes)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def _changed(vmm, before: dict | None) -> tuple[list | None, dict | None, float | None]:  # noqa: ANN001
    """The live ranges to copy into the arena (those whose blocks changed since ``before``,
    the last snapshot's hashes), this snapshot's hashes, and the seconds the hashing took.
    Without the means to hash, every live range is copied and no hashes are kept."""
    from ..gpu import block_hash

    try:
        # the multipliers (on each card with segments) are live memory: allocated first
        block_hash.prepare(block_hash.devices_of(vmm.layout()))
        ranges = vmm.mark_live()
        t0 = time.perf_counter()
        copy, hashes = block_hash.changed(ranges, vmm.layout(), before)
        seconds = time.perf_counter() - t0
        if vmm.mark_live() != ranges:  # the hashing's own memory changed what is live
            return None, None, seconds
        return copy, hashes, seconds
    except Exception:
        vmm.mark_live()
        return None, None, None


def _fallback_once() -> dict | None:
    if _state["told"] or _state["why_not"] is None or not _cuda_in_use():
        return None
    _state["told"] = True
    return {"fallback": _state["why_not"]}


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _await_go(token: str, timeout: float = GO_TIMEOUT_S) -> dict:
    """Wait for the server's word that the dump of this snapshot is over (its "go" file):
    ``{"source": path or None}``. Nothing here touches the GPU or the arena, so a process
    dumped while it waits is restored still waiting, and the restore's word, naming the
    snapshot's own copy of the segments, is the one it then reads."""
    from ..gpu import arena

    path = arena.go_path(os.environ.get(ARENA_ROOT_ENV, ""), token)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                word = json.loads(f.read() or b"{}")
            os.unlink(path)
            return word if isinstance(word, dict) else {}
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            return {}
        if time.monotonic() > deadline:
            raise RuntimeError("the server never said the snapshot's dump was over")
        time.sleep(0.005)


def bring_back(restored: bool = False, source: str | None = None,
               go_timeout: float = GO_TIMEOUT_S) -> dict | None:
    """Resume step (and the first cell after a dump): the segments back on the GPU, once the
    server says the dump is over: from the copy a restore checked out, or from the arena file
    this process's quiesce wrote."""
    if not _state["installed"] or _state["token"] is None:
        return None
    from ..gpu import vmm

    stats = vmm.stats()
    if stats["on_gpu"] == stats["bytes"] and not stats["in_file"]:
        return None  # (a wake that failed mapped them all, unfilled: in_file says so)
    if _state["go"] is None:  # read once: a retry after a failed wake reuses it
        _state["go"] = _await_go(_state["token"], go_timeout)
    word = _state["go"]
    if restored or word.get("source"):
        # a restore: the memory comes from the snapshot's copy, and the arena file holds
        # something else; the next snapshot copies every live range again
        _forget_file()
    path = word.get("source") or source or (None if restored else _state["in_file"])
    if not isinstance(path, str):
        raise RuntimeError("the snapshot's GPU segments were not given back to the kernel")
    t0 = time.perf_counter()
    moved = vmm.wake_from(path)
    _state["in_file"] = _state["token"] = _state["go"] = None
    return {"bytes": moved, "seconds": round(time.perf_counter() - t0, 3)}


def not_back() -> str | None:
    """Why the GPU memory of the last snapshot or restore is not back on the GPU, after one
    more try to bring it back (a copy back that failed leaves it in the arena file); None:
    it is back. Asked before a new snapshot or release (unsavable.why)."""
    if not _state["installed"] or _state["token"] is None:
        return None
    from ..gpu import vmm

    if not vmm.stats()["in_file"]:
        return None
    try:
        bring_back(go_timeout=0)  # the server's word is read by now, or never comes
    except Exception as exc:
        return (f"the kernel's GPU memory did not come back from its last snapshot or restore "
                f"({exc}), so its tensors would be saved unfilled: restore a snapshot, or "
                "restart the kernel")
    return None


def drop_arena() -> None:
    """After a wake from a release: the segments are back on the GPU, and the arena file's
    copy of them would hold as much host memory for nothing while the kernel runs; its pages
    go back (the next snapshot or release copies every live range again)."""
    path = arena_path()
    if not _state["installed"] or _state["token"] is not None or path is None:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # never under a snapshot the server still stores
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    _forget_file()


def before_cell(*_args) -> None:
    """IPython's ``pre_run_cell``: a cell that runs after the quiesce, before the server's
    resume call (sent while the kernel was held), waits for the dump to be over and finds its
    GPU memory back first."""
    if _state["installed"] and _state["token"] is not None:
        try:
            bring_back()
        except Exception as exc:
            print(f"Infinijup: the GPU memory could not be brought back: {exc}",
                  file=sys.stderr)
