"""A GPU snapshot resumed on a machine with other GPUs (or none) is refused, and the reason says
what the snapshot needs. The CPU-only case runs for real in test_machine_b.py; here NVML's
answer is given, as on a GPU machine of another model."""

from __future__ import annotations

import pytest

from infinijup.errors import PreflightRefused
from infinijup.gpu import restore_rules
from infinijup.gpu.fingerprint import Fingerprint, GpuInfo
from infinijup.gpu.preflight import GpuReport


def _fp(name: str, count: int, driver: str, node: str = "a") -> Fingerprint:
    return Fingerprint(gpus=tuple(GpuInfo(index=i, name=name, uuid=f"GPU-{node}{i}",
                                          pci_bus_id=f"0000:{i:02x}:00.0",
                                          memory_total=80 << 30) for i in range(count)),
                       driver_version=driver, cuda_driver_version=13000)


def test_other_hardware_is_refused_with_what_the_snapshot_needs(monkeypatch):
    taken_on = {"gpu": {"fingerprint": _fp("NVIDIA H200", 2, "580.159.04").to_json()}}
    here = _fp("NVIDIA H100 80GB HBM3", 1, "570.86.10")
    monkeypatch.setattr(restore_rules, "read_nvml", lambda: GpuReport(here, ()))
    with pytest.raises(PreflightRefused) as refused:
        restore_rules.plan_gpu_restore(taken_on)
    assert refused.value.reason == "gpu_mismatch"
    message = refused.value.message
    assert "GPU model differs" in message and "NVIDIA H100 80GB HBM3" in message, message
    assert "it needs 2 x NVIDIA H200 under an NVIDIA driver 580.x" in message, message

    # another node of the same kind (other GPUs, a newer driver of the same major): taken,
    # the saved GPUs mapped onto this node's in order
    other_node = _fp("NVIDIA H200", 2, "580.126.09", node="b")
    monkeypatch.setattr(restore_rules, "read_nvml", lambda: GpuReport(other_node, ()))
    assert restore_rules.plan_gpu_restore(taken_on) == (("GPU-a0", "GPU-b0"), ("GPU-a1", "GPU-b1"))
