"""May a snapshot's GPU state be restored on this machine, and onto which GPUs?"""

from __future__ import annotations

from collections import Counter

from ..errors import BadRequest, PreflightRefused
from .fingerprint import Fingerprint, _major, mismatches, remap
from .preflight import read_nvml


def plan_gpu_restore(metadata: dict, *, force: bool = False,
                     requested: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """Check a snapshot's GPU fingerprint against this machine; return the driver's GPU map.

    CPU snapshots: nothing to check, no map. A GPU snapshot whose GPU model, count or driver
    major differs is refused (422) unless ``force``. Saved GPUs that are not here (other
    UUIDs) are mapped onto GPUs of the same model; ``requested`` (saved UUID -> UUID here)
    moves GPUs on purpose, completed into a permutation. Returns () when every GPU stays put.
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
    mapping = dict(remap(saved, current))
    here = {g.uuid for g in current.gpus}
    for old, new in (requested or {}).items():
        if old not in mapping or new not in here:
            raise BadRequest(f"gpu_map: {old} is not a GPU of the snapshot or {new} is not "
                             "a GPU of this machine", reason="bad_gpu_map")
        displaced = next((o for o, n in mapping.items() if n == new and o != old), None)
        if displaced is not None:
            mapping[displaced] = mapping[old]  # swap: keep it a permutation
        mapping[old] = new
    if all(old == new for old, new in mapping.items()):
        return ()
    return tuple(sorted(mapping.items()))


def needs(saved: Fingerprint) -> str:
    """What a machine must have to take a snapshot's GPU state, in words."""
    models = Counter(g.name for g in saved.gpus)
    gpus = " and ".join(f"{n} x {name}" for name, n in sorted(models.items())) or "GPUs"
    driver = _major(saved.driver_version)
    return f"it needs {gpus}" + (f" under an NVIDIA driver {driver}.x" if driver else "")


def check_gpu_fingerprint(metadata: dict) -> None:
    """Refuse (422) a snapshot whose GPU state this machine cannot take; no-op for CPU ones."""
    plan_gpu_restore(metadata)
