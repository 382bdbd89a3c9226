"""The CUDA contexts' local memory, left out of a snapshot.

Every context keeps card memory for its kernels' stacks: the stack size limit times every
thread the card can run at once (264 MiB per H200 at the default 1 KiB; 1 GiB once any kernel
has needed 4 KiB, for the driver grows it at launch and never shrinks it). No allocator of ours
moves it out, so the driver's checkpoint copies it into the kernel's host memory and CRIU dumps
it, then both restore it, though nothing in it outlives a kernel launch. Measured on an H200
(bench/gpu_context_probe.py): 624 MiB of host memory per context at the checkpoint with it,
360 MiB without; the checkpoint 0.39 s against 0.28 s.

So the quiesce, once the GPU work is done, sets each context's stack limit to 0 (the driver
frees the local memory), and the resume sets the limit back to what it was (the driver
allocates it again, under a millisecond). Should the resume never come, or the memory not be
there for it, nothing breaks: the driver grows the stack again at the next launch that needs
it. Where a kernel relies on a limit it set itself (device-side recursion), the resume has put
it back before any cell runs.

Only contexts that exist are touched: libcuda must already be loaded and initialized by the
kernel's own libraries, and only devices whose primary context is active are visited; nothing
here loads or initializes CUDA. ``INFINIJUP_KEEP_GPU_CACHE=1`` leaves them as they are (as it
leaves the libraries' caches, gpu_sync.py).
"""

from __future__ import annotations

import ctypes
import os

from .gpu_sync import KEEP_CACHE_ENV

CU_LIMIT_STACK_SIZE = 0

_saved: dict[int, int] = {}  # device ordinal -> the stack limit the quiesce found


def _libcuda():
    """libcuda if the process has loaded it, else None (never loads it)."""
    try:
        return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return None


class _Current:
    """A device's primary context made current on this thread for a moment, if it is active."""

    def __init__(self, cuda, ordinal: int) -> None:  # noqa: ANN001
        self.cuda, self.ordinal, self.ctx = cuda, ordinal, None

    def __enter__(self) -> bool:
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if (self.cuda.cuDeviceGet(ctypes.byref(dev), self.ordinal) != 0
                or self.cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags),
                                                        ctypes.byref(active)) != 0
                or not active.value):
            return False
        ctx = ctypes.c_void_p()
        if self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return False
        if self.cuda.cuCtxPushCurrent_v2(ctx) != 0:
            self.cuda.cuDevicePrimaryCtxRelease_v2(dev)
            return False
        self.ctx, self.dev = ctx, dev
        return True

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            self.cuda.cuDevicePrimaryCtxRelease_v2(self.dev)


def _devices(cuda) -> int:  # noqa: ANN001
    count = ctypes.c_int()
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:  # not initialized: no context anywhere
        return 0
    return count.value


def _free_bytes(cuda) -> int:  # noqa: ANN001
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
        return 0
    return free.value


def trim() -> int:
    """Set every active context's stack limit to 0 (after the GPU work has finished); return
    the card memory that freed. Never raises."""
    if os.environ.get(KEEP_CACHE_ENV, "") not in ("", "0"):
        return 0
    cuda = _libcuda()
    if cuda is None:
        return 0
    freed = 0
    try:
        for ordinal in range(_devices(cuda)):
            with _Current(cuda, ordinal) as current:
                if not current:
                    continue
                limit = ctypes.c_size_t()
                if cuda.cuCtxGetLimit(ctypes.byref(limit), CU_LIMIT_STACK_SIZE) != 0:
                    continue
                before = _free_bytes(cuda)
                if cuda.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(0)) == 0:
                    _saved.setdefault(ordinal, limit.value)
                    freed += max(0, _free_bytes(cuda) - before)
    except Exception:  # a driver without these entry points: leave the rest as it is
        pass
    return freed


def restore() -> list[str]:
    """Put back the stack limits :func:`trim` found; what could not be put back (the driver
    grows the stack at launch then). Never raises."""
    if not _saved:
        return []
    problems = []
    cuda = _libcuda()
    for ordinal, limit in sorted(_saved.items()):
        try:
            with _Current(cuda, ordinal) as current:
                rc = (cuda.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(limit))
                      if current else "no context")
        except Exception as exc:
            rc = f"{type(exc).__name__}: {exc}"
        if rc != 0:
            problems.append(f"GPU {ordinal}: stack size {limit} not set back ({rc}); the "
                            "driver sets it at the next launch that needs it")
    _saved.clear()
    return problems
