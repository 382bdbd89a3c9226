"""Built-in quiesce steps for GPU kernels: finish queued GPU work, then give back what the GPU
libraries cache but do not use, so that a snapshot holds only live state.

Only frameworks already imported by the user are touched; nothing here imports torch, CuPy or
JAX on its own, and nothing initializes CUDA (that would create a CUDA context, and its memory,
in a kernel that had none).

The release (:func:`release_cached_memory`) frees blocks that PyTorch's caching allocator and
CuPy's memory pools hold *free*: no live tensor or array moves, no address a program holds
changes, nothing in the user's namespace changes. A freed fp32 initialisation of a model that
was then cast to bf16, say, is otherwise dumped, stored and restored as if it were state. Set
``INFINIJUP_KEEP_GPU_CACHE=1`` in the kernel's environment to keep the caches.
"""

from __future__ import annotations

import os
import sys

KEEP_CACHE_ENV = "INFINIJUP_KEEP_GPU_CACHE"


def synchronize_gpus() -> list[str]:
    """Synchronize every CUDA device in use by PyTorch, CuPy or JAX. Returns what was synced."""
    done = []
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None:
        try:
            if torch.cuda.is_initialized():
                for dev in _torch_devices(torch):
                    torch.cuda.synchronize(dev)
                done.append("torch")
        except Exception:
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            for dev in range(cupy.cuda.runtime.getDeviceCount()):
                with cupy.cuda.Device(dev):
                    cupy.cuda.Device(dev).synchronize()
            done.append("cupy")
        except Exception:
            pass
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            for arr in jax.live_arrays():
                arr.block_until_ready()
            done.append("jax")
        except Exception:
            pass
    return done


def _torch_devices(torch) -> list[int]:  # noqa: ANN001
    """Devices where PyTorch holds a context (never one it would have to create)."""
    has_ctx = getattr(torch._C, "_cuda_hasPrimaryContext", lambda dev: True)
    return [dev for dev in range(torch.cuda.device_count()) if has_ctx(dev)]


def release_cached_memory() -> dict:
    """Free the GPU memory that loaded libraries cache but do not use; report it.

    Returns ``{}`` when no GPU library holds CUDA memory (or the release is switched off),
    else per library what was reserved before and after and what is live, in bytes::

        {"torch": {"reserved_before", "reserved_after", "allocated"},
         "cupy": {"reserved_before", "reserved_after", "allocated"},
         "reserved_before", "reserved_after", "allocated"}   # the sums

    Runs after the quiesce hooks (so work they queued is finished). Never raises.
    """
    if os.environ.get(KEEP_CACHE_ENV, "") not in ("", "0"):
        return {}
    out: dict = {}
    for name, release in (("torch", _release_torch), ("cupy", _release_cupy)):
        if name not in sys.modules:
            continue
        try:
            report = release(sys.modules[name])
        except Exception as exc:  # a library that changed its API: keep its cache, say why
            report = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        if report:
            out[name] = report
    if out:
        for key in ("reserved_before", "reserved_after", "allocated"):
            out[key] = sum(int(r.get(key, 0)) for r in out.values() if isinstance(r, dict))
    return out


def _release_torch(torch) -> dict:  # noqa: ANN001
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return {}
    devices = _torch_devices(torch)
    if not devices:
        return {}
    for dev in devices:  # a block is only free once the work that used it has finished
        cuda.synchronize(dev)
    before = sum(int(cuda.memory_reserved(dev)) for dev in devices)
    cuda.empty_cache()  # every device's unused cached blocks (not those of captured graphs)
    return {"reserved_before": before,
            "reserved_after": sum(int(cuda.memory_reserved(dev)) for dev in devices),
            "allocated": sum(int(cuda.memory_allocated(dev)) for dev in devices)}


def _release_cupy(cupy) -> dict:  # noqa: ANN001
    """CuPy's default pools, on the current device only: switching devices would create a
    context on each (CUDA 12's cudaSetDevice does)."""
    pool = cupy.get_default_memory_pool()
    before = int(pool.total_bytes())
    if before == 0:
        return {}
    used = int(pool.used_bytes())
    pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    return {"reserved_before": before, "reserved_after": int(pool.total_bytes()),
            "allocated": used}


def cuda_devices_in_use() -> list[int]:
    """Ordinals of CUDA devices holding a context of an imported framework (best effort)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return list(range(torch.cuda.device_count()))
        except Exception:
            pass
    return []
