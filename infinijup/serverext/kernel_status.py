"""What ``GET /infinijup/status`` answers: one kernel's state, head, GPU memory and (lazily
restored) pages, or, without a kernel, the whole server's (gpu_status.py)."""

from __future__ import annotations

import asyncio

from .. import config
from ..errors import InfinijupError
from ..helper_client import HelperClient
from ..provisioner import InfinijupProvisioner
from . import gpu_status


async def status(m, kernel_id: str | None) -> dict:  # noqa: ANN001 - SnapshotManager
    if not kernel_id:  # the whole server: who holds GPU memory, who rests (issue 27)
        return await gpu_status.server_status(m)
    km = m.kernel(kernel_id)
    managed = isinstance(km.provisioner, InfinijupProvisioner)
    op = m.lifecycle.operation(kernel_id)
    head = m.heads.get(kernel_id)
    return {"kernel_id": kernel_id, "managed": managed,
            "state": m.lifecycle.shown(kernel_id),
            "lifecycle": m.lifecycle.state(kernel_id),
            "operation": {"op": op.op, "phase": op.phase, "percent": op.percent}
            if op else None,
            "last_operation": m.lifecycle.last(kernel_id),
            "head": {"thread": head.thread, "commit": head.commit},
            "remote": m.remote_tier.status(head.commit),
            "gpu": await gpu_status.gpu_view(m, kernel_id),
            "pages": await pages(km) if managed and m.lazy_restore else None}


async def pages(km) -> dict | None:  # noqa: ANN001 - a KernelManager
    """A lazily restored kernel's memory (issue 32): ``{state: streaming | resident | failed,
    resident_s, error}`` as the helper follows it; None: restored whole, or not restored, or
    no process now (hibernated)."""
    root = km.provisioner.root_pid
    if not root:
        return None
    try:
        st = await asyncio.to_thread(HelperClient(config.helper_socket()).status, root)
    except InfinijupError:
        return None
    return st.pages
