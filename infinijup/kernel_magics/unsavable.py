"""What no snapshot of this kernel can carry, found before anything is frozen (issue 33).

A live NCCL communicator ties the kernel to other ranks, to the GPUs' peer mappings and to
proxy threads and sockets that the driver's checkpoint does not save; NVLink SHARP (NVLS)
multicast memory belongs to such a communicator. Saving it would give a kernel that hangs in
its next collective. The quiesce asks :func:`why` first and, when it answers, does nothing
else: the server refuses the snapshot or release with the reason and the kernel runs on as
it was.

Only libraries already imported are looked at; nothing here imports or initializes one.
"""

from __future__ import annotations

import sys

REASON = "live_nccl"


def why() -> str | None:
    """Why this kernel cannot be saved now, with what to do (None: nothing known stops it)."""
    return _torch_distributed()


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
