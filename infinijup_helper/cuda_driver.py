"""The CUDA driver's process checkpoint API (driver >= 570) through cuda-python.

``cuCheckpointProcessLock`` stops new CUDA work of a process, ``...Checkpoint`` moves its device
memory to host memory and releases the GPU, ``...Restore`` brings it back and ``...Unlock`` lets
it run. The driver has no rollback of its own: callers unwind with :func:`resume`.

The helper's own (it imports nothing of the ``infinijup`` package: see
scripts/install_helper.py); the benchmarks call it too. Hold points (holds.py) for the fault
tests: ``cuda_locked`` (locked, not checkpointed), ``cuda_checkpointed`` (the helper has not
answered yet), ``cuda_restored`` (back on the GPU, still locked).
"""

from __future__ import annotations

import enum
from functools import lru_cache

from .holds import hold


class CudaError(Exception):
    """A driver call failed; ``reason`` is a short stable code, as in infinijup/errors.py."""

    reason = "cuda_failed"
    http_status = 500

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class CudaState(enum.Enum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    NONE = "none"  # the process holds no CUDA context


@lru_cache(maxsize=1)
def _driver():
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python
        except ImportError as exc:
            raise CudaError("cuda-python is not installed: pip install 'infinijup[gpu]'",
                            reason="cuda_unavailable") from exc
    (err,) = driver.cuInit(0)
    if int(err) != 0:
        raise CudaError(f"cuInit failed ({_name(driver, err)}): no usable NVIDIA driver",
                        reason="cuda_unavailable")
    if not hasattr(driver, "cuCheckpointProcessLock"):
        raise CudaError("this cuda-python has no process checkpoint API (needs CUDA 12.8+)",
                        reason="cuda_unavailable")
    return driver


def _name(driver, err) -> str:
    try:
        return getattr(err, "name", None) or str(err)
    except Exception:
        return str(err)


def available() -> bool:
    try:
        _driver()
        return True
    except CudaError:
        return False


def _check(result, what: str, pid: int) -> object:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaError(f"{what} of process {pid} failed: {_name(_driver(), err)}")
    return rest[0] if rest else None


def state(pid: int) -> CudaState:
    drv = _driver()
    err, st = drv.cuCheckpointProcessGetState(pid)
    if int(err) != 0:
        return CudaState.NONE  # not a CUDA process (CUDA_ERROR_NOT_FOUND / NOT_INITIALIZED)
    name = getattr(st, "name", str(st)).upper()
    for s in (CudaState.RUNNING, CudaState.LOCKED, CudaState.CHECKPOINTED, CudaState.FAILED):
        if s.name in name:
            return s
    return CudaState.FAILED


def lock(pid: int, timeout_ms: int) -> None:
    drv = _driver()
    args = drv.CUcheckpointLockArgs()
    args.timeoutMs = int(timeout_ms)
    _check(drv.cuCheckpointProcessLock(pid, args), "CUDA lock", pid)


def checkpoint(pid: int) -> None:
    drv = _driver()
    _check(drv.cuCheckpointProcessCheckpoint(pid, None), "CUDA checkpoint", pid)


def _uuid(drv, text: str):
    """NVML's ``GPU-xxxxxxxx-xxxx-...`` as the driver's CUuuid."""
    import ctypes

    raw = bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))
    if len(raw) != 16:
        raise CudaError(f"not a GPU UUID: {text!r}", reason="bad_gpu_map")
    u = drv.CUuuid()
    ctypes.memmove(u.getPtr(), raw, 16)  # the binding's `bytes` is read-only
    if bytes(u.bytes)[:16] != raw:
        raise CudaError("could not build a CUuuid", reason="cuda_failed")
    return u


def restore(pid: int, gpu_map: tuple[tuple[str, str], ...] = ()) -> None:
    """Bring a checkpointed process back onto GPUs. ``gpu_map`` pairs (saved UUID, target
    UUID) remap its devices: the driver's migration onto other GPUs of the same model."""
    drv = _driver()
    args = None
    if gpu_map:
        args = drv.CUcheckpointRestoreArgs()
        pairs = []
        for old, new in gpu_map:
            pair = drv.CUcheckpointGpuPair()
            pair.oldUuid = _uuid(drv, old)
            pair.newUuid = _uuid(drv, new)
            pairs.append(pair)
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
    _check(drv.cuCheckpointProcessRestore(pid, args), "CUDA restore", pid)


def unlock(pid: int) -> None:
    drv = _driver()
    _check(drv.cuCheckpointProcessUnlock(pid, None), "CUDA unlock", pid)


def suspend(pid: int, timeout_ms: int) -> None:
    """Lock and checkpoint: the process's VRAM goes to host memory; unwinds on failure."""
    lock(pid, timeout_ms)
    try:
        hold("cuda_locked", pid=pid)
        checkpoint(pid)
    except CudaError:
        unlock(pid)
        raise
    hold("cuda_checkpointed", pid=pid)


def resume(pid: int, gpu_map: tuple[tuple[str, str], ...] = ()) -> None:
    """Bring a process back to RUNNING from whatever checkpoint state it is in."""
    st = state(pid)
    if st is CudaState.CHECKPOINTED:
        restore(pid, gpu_map)
        st = CudaState.LOCKED
        hold("cuda_restored", pid=pid)
    if st is CudaState.LOCKED:
        unlock(pid)
