"""NVML, for the server: this machine's GPUs and driver (the restore rules), and what GPU memory
each process holds (making room on a GPU).

NVML is read by the helper's reader (infinijup_helper/cuda_preflight.py), which imports nothing
of this package, so this one can use it: one reader, whose fingerprint the helper puts into a
commit and fingerprint.py reads back. What the driver's checkpoint cannot carry is refused in
the helper's CUDA stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infinijup_helper import cuda_preflight as nvml
from infinijup_helper.cuda_preflight import GpuProcess

from ..errors import PreflightRefused
from .fingerprint import Fingerprint

__all__ = ["GpuProcess", "GpuReport", "read_nvml"]


@dataclass(frozen=True)
class GpuReport:
    fingerprint: Fingerprint
    processes: tuple[GpuProcess, ...]
    mps: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)

    usage_by_gpu = nvml.GpuReport.usage_by_gpu  # bytes by GPU of the processes in ``pids``


def read_nvml() -> GpuReport:
    """Read GPUs, driver and GPU processes from NVML (nvidia-ml-py)."""
    try:
        report = nvml.read_nvml()
    except nvml.PreflightRefused as exc:
        raise PreflightRefused(str(exc), reason=exc.reason) from exc
    return GpuReport(fingerprint=Fingerprint.from_json(report.fingerprint),
                     processes=report.processes, mps=report.mps)
