"""Hardware fingerprints: what a GPU snapshot needs to be restored.

A snapshot's device memory can only go back onto GPUs of the same model and count, under a
driver of the same major version. Other GPUs of the same model (other UUIDs) are fine: the
driver maps the saved devices onto them in order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total: int
    mig_enabled: bool = False


@dataclass(frozen=True)
class Fingerprint:
    gpus: tuple[GpuInfo, ...]
    driver_version: str
    cuda_driver_version: int  # e.g. 13000 for CUDA 13.0
    extra: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        return {"gpus": [asdict(g) for g in self.gpus], "driver_version": self.driver_version,
                "cuda_driver_version": self.cuda_driver_version}

    @classmethod
    def from_json(cls, data: dict) -> Fingerprint:
        return cls(gpus=tuple(GpuInfo(**g) for g in data.get("gpus", [])),
                   driver_version=str(data.get("driver_version", "")),
                   cuda_driver_version=int(data.get("cuda_driver_version", 0)))


def _major(version: str) -> str:
    return version.split(".")[0] if version else ""


def mismatches(saved: Fingerprint, current: Fingerprint) -> list[str]:
    """Why ``saved`` cannot be restored on ``current`` (empty: it can)."""
    reasons = []
    if len(current.gpus) < len(saved.gpus):
        reasons.append(f"the snapshot used {len(saved.gpus)} GPU(s), this machine has "
                       f"{len(current.gpus)}")
    saved_models = sorted(g.name for g in saved.gpus)
    current_models = sorted(g.name for g in current.gpus)[: len(saved_models)]
    if saved_models and saved_models != current_models:
        reasons.append(f"GPU model differs: snapshot {', '.join(saved_models)}, here "
                       f"{', '.join(current_models) or 'none'}")
    if saved.driver_version and _major(saved.driver_version) != _major(current.driver_version):
        reasons.append(f"NVIDIA driver differs: snapshot {saved.driver_version}, here "
                       f"{current.driver_version or 'none'}")
    return reasons


def remap(saved: Fingerprint, current: Fingerprint) -> list[tuple[str, str]]:
    """Pairs (saved uuid, current uuid) by model, keeping order; identity where UUIDs match."""
    pairs = []
    free = list(current.gpus)
    for g in saved.gpus:
        same = next((c for c in free if c.uuid == g.uuid), None) or \
            next((c for c in free if c.name == g.name), None)
        if same is None:
            break
        free.remove(same)
        pairs.append((g.uuid, same.uuid))
    return pairs
