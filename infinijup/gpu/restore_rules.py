"""May a snapshot's GPU state be restored on this machine, and onto which GPUs?"""

from __future__ import annotations

from collections import Counter

from ..errors import BadRequest, PreflightRefused
from .fingerprint import Fingerprint, _major, link_mismatches, mismatches, remap
from .preflight import read_nvml


def plan_gpu_restore(metadata: dict, *, force: bool = False,
                     requested: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """Check a snapshot's GPU fingerprint against this machine; return the driver's GPU map.

    CPU snapshots: nothing to check, no map. A GPU snapshot whose GPU model, count or driver
    major differs is refused (422) unless ``force``. Saved GPUs that are not here (other
    UUIDs) are mapped onto GPUs of the same model, the ones the kernel used onto cards joined
    as they were (NVLink, PCIe); ``requested`` (saved UUID -> UUID here) moves GPUs on
    purpose, completed into a permutation. Cards the kernel used that would be joined
    otherwise than in the snapshot are refused too (422, unless ``force``), before anything
    is touched. Returns () when every GPU stays put.
    """
    saved_json = (metadata.get("gpu") or {}).get("fingerprint")
    if not saved_json:
        if requested:
            raise BadRequest("this snapshot holds no GPU state: gpu_map does not apply")
        return ()
    saved = Fingerprint.from_json(saved_json)
    try:
        current = read_nvml().fingerprint
    except PreflightRefused as exc:
        raise PreflightRefused(f"this snapshot holds GPU state ({needs(saved)}), but "
                               f"{exc.message}", reason="gpu_mismatch") from None
    reasons = mismatches(saved, current)
    if reasons and not force:
        raise PreflightRefused(
            "this snapshot's GPU state cannot be restored here: " + "; ".join(reasons)
            + f"; {needs(saved)} (restore with \"force\": true to try anyway)",
            reason="gpu_mismatch")
    used = used_gpus(metadata)
    mapping = dict(remap(saved, current, used))
    here = {g.uuid for g in current.gpus}
    for old, new in (requested or {}).items():
        if old not in mapping or new not in here:
            raise BadRequest(f"gpu_map: {old} is not a GPU of the snapshot or {new} is not "
                             "a GPU of this machine", reason="bad_gpu_map")
        displaced = next((o for o, n in mapping.items() if n == new and o != old), None)
        if displaced is not None:
            mapping[displaced] = mapping[old]  # swap: keep it a permutation
        mapping[old] = new
    links = link_mismatches(saved, current, mapping, used)
    if links and not force:
        raise PreflightRefused(
            "this snapshot's GPU state cannot be restored onto these GPUs: " + "; ".join(links)
            + " (peer access the kernel set up may not exist there; restore with \"force\": "
            "true to try anyway)", reason="gpu_topology")
    if all(old == new for old, new in mapping.items()):
        return ()
    return tuple(sorted(mapping.items()))


def used_gpus(metadata: dict) -> list[str]:
    """UUIDs of the GPUs the kernel held memory on when it was saved (the helper's per-GPU
    count from NVML), in the fingerprint's order."""
    gpu = metadata.get("gpu") or {}
    held = set((gpu.get("vram_bytes") or {}).keys())
    order = [g.get("uuid") for g in (gpu.get("fingerprint") or {}).get("gpus", [])]
    return [u for u in order if u in held]


def needs(saved: Fingerprint) -> str:
    """What a machine must have to take a snapshot's GPU state, in words."""
    models = Counter(g.name for g in saved.gpus)
    gpus = " and ".join(f"{n} x {name}" for name, n in sorted(models.items())) or "GPUs"
    driver = _major(saved.driver_version)
    return f"it needs {gpus}" + (f" under an NVIDIA driver {driver}.x" if driver else "")


def check_gpu_fingerprint(metadata: dict) -> None:
    """Refuse (422) a snapshot whose GPU state this machine cannot take; no-op for CPU ones."""
    plan_gpu_restore(metadata)
