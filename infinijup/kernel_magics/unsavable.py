"""What no snapshot of this kernel can carry, found before anything is frozen (issue 33).

- A live NCCL communicator ties the kernel to other ranks, to the GPUs' peer mappings and to
  proxy threads and sockets that the driver's checkpoint does not save; NVLink SHARP (NVLS)
  multicast memory belongs to such a communicator. Saving it would give a kernel that hangs
  in its next collective.
- GPU memory shared with another process through CUDA IPC (a CUDA tensor sent or received
  with ``torch.multiprocessing``): the mapping belongs to the other process's allocation,
  which a restore cannot bring back. PyTorch keeps every such storage in its sharing cache,
  which is what is looked at; IPC handles opened by other libraries (CuPy, raw CUDA) are not
  seen here.
- GPU memory that did not come back from the last snapshot or restore (its copy back onto the
  GPU failed, and a new try now fails too, gpu_vmm.not_back): its tensors would be saved
  unfilled.

The quiesce asks :func:`why` first and, when it answers, does nothing else: the server refuses
the snapshot or release with the reason and the kernel runs on as it was.

Only libraries already imported are looked at; nothing here imports or initializes one.
"""

from __future__ import annotations

import sys

LIVE_NCCL = "live_nccl"
CUDA_IPC = "cuda_ipc"
GPU_NOT_BACK = "gpu_not_back"


def why() -> tuple[str, str] | None:
    """(reason, why this kernel cannot be saved now and what to do), or None: nothing known
    stops it."""
    for reason, check in ((LIVE_NCCL, _torch_distributed), (CUDA_IPC, _torch_cuda_ipc),
                          (GPU_NOT_BACK, _gpu_not_back)):
        text = check()
        if text is not None:
            return reason, text
    return None


def _torch_distributed() -> str | None:
    if "torch.distributed" not in sys.modules:
        return None
    dist = sys.modules["torch.distributed"]
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        backend = str(dist.get_backend())
    except Exception:
        return None
    if "nccl" not in backend.lower():
        return None
    return ("the kernel holds a live NCCL communicator (torch.distributed process group, "
            f"backend {backend!r}), which no checkpoint can carry: call "
            "torch.distributed.destroy_process_group() first, then snapshot (and create the "
            "group again after a restore)")


def _torch_cuda_ipc() -> str | None:
    reductions = sys.modules.get("torch.multiprocessing.reductions")
    torch = sys.modules.get("torch")
    if reductions is None or torch is None:
        return None
    shared = 0
    for ref in list(getattr(reductions, "shared_cache", {}).values()):
        try:
            if ref.expired():
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is not None and storage.device.type == "cuda":
                shared += 1
        except Exception:
            continue
    if not shared:
        return None
    return (f"the kernel holds GPU memory shared with another process through CUDA IPC "
            f"({shared} CUDA storage{'s' if shared > 1 else ''} sent or received with "
            "torch.multiprocessing), which no checkpoint can carry: delete those tensors here "
            "(keep a .clone() where the values are needed), call gc.collect() and "
            "torch.cuda.ipc_collect(), then snapshot")


def _gpu_not_back() -> str | None:
    from . import gpu_vmm

    return gpu_vmm.not_back()
