"""How much GPU memory is free, how much a kernel holds (NVML) and whether it uses CUDA at all,
for the idle policy and for making room on a GPU before a released kernel takes its memory
back (serverext/hibernation.py)."""

from __future__ import annotations

from ..process import tree_pids


def free_by_gpu() -> dict[str, int]:
    """Free bytes of each GPU, by UUID."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            out[uuid] = int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
        return out
    finally:
        pynvml.nvmlShutdown()


def held_by_tree(root: int, report=None) -> dict[str, int]:  # noqa: ANN001
    """Bytes the processes of the tree at ``root`` hold on each GPU, by UUID (``report``: an
    NVML reading to use, for several kernels at once)."""
    from .preflight import read_nvml

    return (report or read_nvml()).usage_by_gpu(set(tree_pids(root)))


def uses_cuda(root: int) -> bool:
    """Does any process of the tree at ``root`` map the CUDA driver?"""
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if any("libcuda.so" in line for line in f):
                    return True
        except OSError:
            continue
    return False
