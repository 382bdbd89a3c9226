"""May a snapshot's GPU state be restored on this machine?"""

from __future__ import annotations

from ..errors import PreflightRefused
from .fingerprint import Fingerprint, mismatches
from .preflight import read_nvml


def check_gpu_fingerprint(metadata: dict) -> None:
    """Refuse (422) a snapshot whose GPU state this machine cannot take; no-op for CPU ones.

    The user may override with ``"force": true`` on the restore request.
    """
    saved = (metadata.get("gpu") or {}).get("fingerprint")
    if not saved:
        return
    try:
        current = read_nvml().fingerprint
    except PreflightRefused as exc:
        raise PreflightRefused(f"this snapshot holds GPU state, but {exc.message}",
                               reason="gpu_mismatch") from None
    reasons = mismatches(Fingerprint.from_json(saved), current)
    if reasons:
        raise PreflightRefused(
            "this snapshot's GPU state cannot be restored here: " + "; ".join(reasons)
            + " (restore with \"force\": true to try anyway)", reason="gpu_mismatch")
