"""Where each kernel's GPU memory is, for ``/infinijup/status`` and the Lab's status bar
(issue 27): on its GPUs, in host memory (released), in the store (hibernated)."""

from __future__ import annotations

import asyncio

from ..engine.lifecycle import HIBERNATED, RELEASED, RUNNING
from ..gpu import room
from ..gpu.preflight import read_nvml


async def gpu_view(m, kernel_id: str, report=None) -> dict | None:  # noqa: ANN001 - the SnapshotManager
    """``{"where": "gpu" | "host" | "store", "bytes", "by_gpu"}`` (host: released; store:
    hibernated), or None (no GPU memory, or no way to tell here). ``report``: one NVML
    reading for all the kernels of a server's status (the status bar asks every 5 s)."""
    state = m.lifecycle.state(kernel_id)
    rest = m.hibernation.rests.get(kernel_id)
    try:
        if state == RELEASED and rest is not None and rest.vram:
            by_gpu, where = dict(rest.vram), "host"
        elif state == HIBERNATED and rest is not None and rest.commit:
            meta = (await asyncio.to_thread(m.repo().get_commit, rest.commit)).metadata or {}
            by_gpu, where = dict((meta.get("gpu") or {}).get("vram_bytes") or {}), "store"
        elif state == RUNNING and report is not None:
            root = m.provisioner(m.kernel(kernel_id)).root_pid
            by_gpu, where = (room.held_by_tree(root, report) if root else {}), "gpu"
        elif state == RUNNING and m.uses_gpu(kernel_id):
            by_gpu, where = await m.gpu_held(kernel_id), "gpu"
        else:
            return None
    except Exception:  # no NVML, a kernel going away: nothing to say
        return None
    if not by_gpu:
        return None
    return {"where": where, "bytes": int(sum(by_gpu.values())), "by_gpu": by_gpu}


async def server_status(m) -> dict:  # noqa: ANN001
    """Every kernel of the server (its notebook, state, GPU memory) and each GPU's free bytes."""
    try:
        free = await m.gpu_free()
        report = await asyncio.to_thread(read_nvml)  # once, for every kernel below
    except Exception:  # no GPU, no NVML
        free, report = {}, None
    kernels = []
    for kernel_id in m.kernel_manager.list_kernel_ids():
        kernels.append({"kernel_id": kernel_id, "path": await m.notebook_path(kernel_id),
                        "state": m.lifecycle.shown(kernel_id),
                        "gpu": await gpu_view(m, kernel_id, report)})
    return {"kernels": kernels,
            "gpus": [{"uuid": g, "free_bytes": n} for g, n in sorted(free.items())]}
