"""NVML, for the server: this machine's GPUs and driver (the restore rules), and what GPU memory
each process holds (making room on a GPU).

The helper's CUDA stage reads NVML itself and refuses there what the driver's checkpoint cannot
carry (infinijup_helper/cuda_preflight.py: the helper imports nothing of this package); the
fingerprint it puts into a commit is read back with fingerprint.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PreflightRefused
from .fingerprint import Fingerprint, GpuInfo


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_uuid: str
    used_bytes: int


@dataclass(frozen=True)
class GpuReport:
    fingerprint: Fingerprint
    processes: tuple[GpuProcess, ...]
    mps: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def usage_by_gpu(self, pids: set[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.processes:
            if p.pid in pids:
                out[p.gpu_uuid] = out.get(p.gpu_uuid, 0) + p.used_bytes
        return out


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml() -> GpuReport:
    """Read GPUs, driver and GPU processes from NVML (nvidia-ml-py)."""
    try:
        import pynvml
    except ImportError as exc:
        raise PreflightRefused("nvidia-ml-py is not installed: pip install 'infinijup[gpu]'",
                               reason="nvml_unavailable") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        raise PreflightRefused(f"NVML could not start ({exc}): is the NVIDIA driver loaded?",
                               reason="nvml_unavailable") from exc
    try:
        gpus, procs = [], []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                mig = bool(pynvml.nvmlDeviceGetMigMode(h)[0])
            except Exception:
                mig = False
            uuid = _s(pynvml.nvmlDeviceGetUUID(h))
            gpus.append(GpuInfo(index=i, name=_s(pynvml.nvmlDeviceGetName(h)), uuid=uuid,
                                pci_bus_id=_s(pynvml.nvmlDeviceGetPciInfo(h).busId),
                                memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                                mig_enabled=mig))
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                procs.append(GpuProcess(pid=int(p.pid), gpu_uuid=uuid, used_bytes=int(used)))
        fp = Fingerprint(gpus=tuple(gpus),
                         driver_version=_s(pynvml.nvmlSystemGetDriverVersion()),
                         cuda_driver_version=int(pynvml.nvmlSystemGetCudaDriverVersion()))
        return GpuReport(fingerprint=fp, processes=tuple(procs))
    finally:
        pynvml.nvmlShutdown()
