"""Built-in quiesce hook: finish queued GPU work before the process is frozen.

Only frameworks already imported by the user are touched; nothing here imports torch, CuPy or
JAX on its own (that would create a CUDA context in a kernel that had none).
"""

from __future__ import annotations

import sys


def synchronize_gpus() -> list[str]:
    """Synchronize every CUDA device in use by PyTorch, CuPy or JAX. Returns what was synced."""
    done = []
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None:
        try:
            if torch.cuda.is_initialized():
                has_ctx = getattr(torch._C, "_cuda_hasPrimaryContext", lambda dev: True)
                for dev in range(torch.cuda.device_count()):
                    if has_ctx(dev):  # never create a context (and its memory) on another GPU
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
