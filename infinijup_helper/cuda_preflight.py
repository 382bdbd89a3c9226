"""NVML preflight of the CUDA stage: can this process tree's GPU state be saved, and how much of
it is there?

Refuses, before anything is frozen, what the driver's checkpoint cannot carry: MIG instances,
a driver older than 570, a process outside the tree sharing the tree's GPU memory through MPS.

The helper's own (it imports nothing of the ``infinijup`` package: see
scripts/install_helper.py). The server reads NVML itself (infinijup/gpu/preflight.py); the
fingerprint read here goes into the commit as the JSON that infinijup/gpu/fingerprint.py's
``Fingerprint.from_json`` reads back (tests/gpu/test_gpu_rules.py holds the two to one shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_DRIVER_MAJOR = 570


class PreflightRefused(Exception):
    """What cannot be saved, said before anything is frozen; ``reason`` is a short stable code,
    as in infinijup/errors.py."""

    reason = "preflight_refused"
    http_status = 422

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_uuid: str
    used_bytes: int


@dataclass(frozen=True)
class GpuReport:
    # {"gpus": [{index, name, uuid, pci_bus_id, memory_total, mig_enabled}, ...],
    #  "driver_version", "cuda_driver_version", "links": [{a, b, kind, path}, ...]}:
    #  Fingerprint.to_json()'s shape
    fingerprint: dict[str, Any]
    processes: tuple[GpuProcess, ...]
    mps: bool = False

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
        gpus, procs, handles = [], [], []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(h)
            try:
                mig = bool(pynvml.nvmlDeviceGetMigMode(h)[0])
            except Exception:
                mig = False
            uuid = _s(pynvml.nvmlDeviceGetUUID(h))
            gpus.append({"index": i, "name": _s(pynvml.nvmlDeviceGetName(h)), "uuid": uuid,
                         "pci_bus_id": _s(pynvml.nvmlDeviceGetPciInfo(h).busId),
                         "memory_total": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                         "mig_enabled": mig})
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                procs.append(GpuProcess(pid=int(p.pid), gpu_uuid=uuid, used_bytes=int(used)))
        fp = {"gpus": gpus, "driver_version": _s(pynvml.nvmlSystemGetDriverVersion()),
              "cuda_driver_version": int(pynvml.nvmlSystemGetCudaDriverVersion())}
        if len(handles) > 1:
            fp["links"] = links(pynvml, handles)
        return GpuReport(fingerprint=fp, processes=tuple(procs))
    finally:
        pynvml.nvmlShutdown()


# NVML's nvmlGpuP2PCapsIndex_t (nvidia-ml-py spells NVML_P2P_CAPS_INDEX_READ as a tuple)
P2P_READ, P2P_NVLINK = 0, 2
PATHS = {0: "same board", 10: "one PCIe switch", 20: "several PCIe switches",
         30: "one host bridge", 40: "one NUMA node", 50: "across NUMA nodes"}


def links(pynvml, handles: list) -> list[dict]:  # noqa: ANN001
    """How each pair of GPUs reaches the other: "nvlink", "pcie" (peer-to-peer over PCIe) or
    "host" (through host memory); the PCIe path between them, as NVML names it."""
    def p2p(a, b, index: int) -> bool:
        try:
            return pynvml.nvmlDeviceGetP2PStatus(a, b, index) == pynvml.NVML_P2P_STATUS_OK
        except Exception:
            return False

    out = []
    for i, a in enumerate(handles):
        for j in range(i + 1, len(handles)):
            b = handles[j]
            if p2p(a, b, P2P_NVLINK):
                kind = "nvlink"
            elif p2p(a, b, P2P_READ):
                kind = "pcie"
            else:
                kind = "host"
            try:
                path = PATHS.get(int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)), "")
            except Exception:
                path = ""
            out.append({"a": i, "b": j, "kind": kind, "path": path})
    return out


def check(report: GpuReport, tree_pids: set[int]) -> list[str]:
    """Raise PreflightRefused for what cannot be saved; return warnings for what can."""
    fp = report.fingerprint
    driver_version = fp["driver_version"]
    try:
        major = int(driver_version.split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_DRIVER_MAJOR:
        raise PreflightRefused(
            f"NVIDIA driver {driver_version or 'unknown'} has no process checkpoint API: "
            f"upgrade to {MIN_DRIVER_MAJOR} or newer", reason="driver_too_old")
    used = {p.gpu_uuid for p in report.processes if p.pid in tree_pids}
    for g in fp["gpus"]:
        if g["uuid"] in used and g["mig_enabled"]:
            raise PreflightRefused(
                f"GPU {g['index']} ({g['name']}) is in MIG mode: the driver cannot checkpoint "
                "MIG instances; run the kernel on a GPU without MIG", reason="mig_unsupported")
    if report.mps:
        raise PreflightRefused("the kernel's GPU is shared through MPS, which the driver's "
                               "checkpoint does not support", reason="mps_unsupported")
    warnings = []
    for p in report.processes:
        if p.gpu_uuid in used and p.pid not in tree_pids:
            warnings.append(f"process {p.pid} outside the kernel also uses GPU {p.gpu_uuid}; "
                            "its memory is not part of the snapshot")
    return warnings
