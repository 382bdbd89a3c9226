"""What the server calls inside the kernel, as a silent execute request.

The server sends ``user_expressions`` that call :func:`quiesce` or :func:`resume`; the result is
a JSON string, so the server needs nothing from IPython to read it. Nothing here may raise (an
error in a user expression would set ``sys.last_*``) or write to the user's namespace.
"""

from __future__ import annotations

import json
import time

from ..gpu import vmm
from . import describe, gpu_vmm, hooks, isolation


def _shell():
    try:
        from IPython import get_ipython

        return get_ipython()
    except Exception:
        return None


def _execution_count(ip) -> int | None:  # noqa: ANN001
    try:
        return int(ip.execution_count) - 1 if ip is not None else None
    except Exception:
        return None


def _answer(ip, info: dict) -> str:  # noqa: ANN001
    info["execution_count"] = _execution_count(ip)
    try:
        isolation.put_back_last_result(ip)
    except Exception:
        pass
    return json.dumps(info)


def _stale(ip, deadline: float | None) -> str | None:  # noqa: ANN001
    """The server gave up on this request (it waited behind a cell past ``deadline``): do
    nothing, say so (engine/kernel_channel.run_agent)."""
    if isinstance(deadline, (int, float)) and time.time() > deadline:
        return _answer(ip, {"stale": True})
    return None


def quiesce(deadline: float | None = None) -> str:
    """Bring the kernel to a point safe to freeze; report its last cell and its variables."""
    ip = _shell()
    stale = _stale(ip, deadline)
    if stale is not None:
        return stale
    try:
        info = hooks.run_quiesce()
    except Exception as exc:
        info = {"hook_errors": [str(exc)]}
    if ip is not None:
        try:
            info.update(describe.describe(ip))
        except Exception as exc:
            info["describe_error"] = f"{type(exc).__name__}: {exc}"
    return _answer(ip, info)


def release(deadline: float | None = None) -> str:
    """An idle kernel gives its GPUs back (serverext/hibernation.py): the quiesce hooks move
    PyTorch's segments into the arena file at copy-engine speed and release the libraries'
    caches, so that the helper's driver checkpoint takes only what is left (the CUDA context,
    other libraries' memory). ``resume`` brings the segments back once the server says go."""
    ip = _shell()
    stale = _stale(ip, deadline)
    if stale is not None:
        return stale
    try:
        info = hooks.run_quiesce()
    except Exception as exc:
        info = {"hook_errors": [str(exc)]}
    return _answer(ip, info)


def wake() -> str:
    """After ``release`` and the helper's reacquire: the segments back from the arena file, the
    resume hooks, then the file's pages back to host memory (gpu_vmm.drop_arena)."""
    ip = _shell()
    try:
        info = hooks.run_resume(False)
    except Exception as exc:
        info = {"hook_errors": [str(exc)]}
    try:
        gpu_vmm.drop_arena()
    except Exception as exc:
        info.setdefault("hook_errors", []).append(f"arena: {exc}")
    return _answer(ip, info)


def resume(restored: bool = False, committed: bool = True, segments: str | None = None) -> str:
    """Run the resume hooks. ``committed`` False: the snapshot is still being stored (the
    kernel goes on after its dump), so a failed ingest can still ``forget`` it. ``segments``:
    the restored snapshot's GPU segments (gpu_vmm.py)."""
    ip = _shell()
    try:
        info = hooks.run_resume(bool(restored), segments if isinstance(segments, str) else None)
    except Exception as exc:
        info = {"hook_errors": [str(exc)]}
    if committed:
        describe.committed()
    return _answer(ip, info)


def forget() -> str:
    """The snapshot quiesced for was not committed: keep the parent's fingerprints."""
    ip = _shell()
    describe.forget()
    return _answer(ip, {})


def autosnapshot(on: bool | None = None) -> str:
    """Turn this kernel's automatic snapshots on or off (None: leave them); what they are."""
    from . import autosnap

    ip = _shell()
    auto = autosnap.instance()
    if auto is None:
        return _answer(ip, {"installed": False})
    if on is not None:
        auto.settings.on = bool(on)
    s = auto.settings
    return _answer(ip, {"installed": True, "on": s.on, "share": s.share, "after_s": s.after_s,
                        "taken": auto.taken, "skipped": auto.skipped,
                        "failures": auto.failures, "last_error": auto.last_error})


def expression(name: str, *args: object) -> str:
    """The user expression that calls ``name(*args)`` in this module (for the server)."""
    call_args = ", ".join(repr(a) for a in args)
    return f"__import__('infinijup.kernel_magics.agent', fromlist=['_']).{name}({call_args})"


def _clean_item(item: object) -> dict | None:
    if not isinstance(item, dict):
        return None
    name, kind, size, shape, fp = (item.get(k) for k in ("name", "type", "size", "shape", "fp"))
    if not (isinstance(name, str) and isinstance(kind, str) and isinstance(fp, str)):
        return None
    out = {"name": name[:200], "type": kind[:200],
           "size": size if type(size) is int and size >= 0 else 0,
           "shape": shape[:200] if isinstance(shape, str) else None,
           "fp": fp[:64], "changed": bool(item.get("changed", True))}
    value = item.get("value")
    if isinstance(value, str):  # what Compare shows (describe.py cut it to 60 characters)
        out["value"] = value[:200]
    if item.get("partial") is True:  # too large to look at fully: "unchanged" may miss
        out["partial"] = True
    return out


def _clean_release(report: object) -> dict:
    """gpu_sync.release_cached_memory's report, byte counts only."""
    if not isinstance(report, dict):
        return {}
    out: dict = {}
    for key, value in report.items():
        if key in ("reserved_before", "reserved_after", "allocated", "local_memory"):
            if type(value) is int and value >= 0:
                out[key] = value
        elif key in ("torch", "cupy") and isinstance(value, dict):
            lib = {k: v for k, v in value.items()
                   if k in ("reserved_before", "reserved_after", "allocated")
                   and type(v) is int and v >= 0}
            if isinstance(value.get("error"), str):
                lib["error"] = value["error"][:200]
            if lib:
                out[key] = lib
    return out


def _clean_segments(report: object) -> dict:
    """gpu_vmm.offload's report: bytes moved into the arena file, or why not."""
    if not isinstance(report, dict):
        return {}
    if isinstance(report.get("fallback"), str):
        return {"fallback": report["fallback"][:300]}
    out = {k: report[k] for k in ("bytes", "segments", "segment_bytes")
           if type(report.get(k)) is int and report[k] >= 0}
    for key in ("seconds", "hash_s", *vmm.TIMING_KEYS):
        if isinstance(report.get(key), (int, float)) and report[key] >= 0:
            out[key] = float(report[key])
    token = report.get("token")
    if isinstance(token, str) and len(token) == 32 and all(c in "0123456789abcdef" for c in token):
        out["token"] = token
    return out if out.get("bytes") or out.get("segment_bytes") else {}


def _clean_sidecars(items: object) -> list[dict]:
    """sidecars.describe's list: names, commands, pids, whether each runs."""
    if not isinstance(items, list):
        return []
    out = []
    for item in items[:50]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        argv = item.get("argv")
        out.append({"name": item["name"][:64],
                    "argv": [a[:200] for a in argv[:20] if isinstance(a, str)]
                    if isinstance(argv, list) else [],
                    "pid": item["pid"] if type(item.get("pid")) is int else None,
                    "running": bool(item.get("running"))})
    return out


def refusal(info: object) -> tuple[str, str] | None:
    """For the server: (why, reason) when the kernel's quiesce found state no snapshot can
    carry and touched nothing (unsavable.py); None otherwise."""
    if not isinstance(info, dict):
        return None
    why, reason = info.get("refused"), info.get("refused_reason")
    if not isinstance(why, str) or not why:
        return None
    return why[:2000], reason if isinstance(reason, str) and reason.isidentifier() else "refused"


def commit_metadata(info: object) -> dict:
    """For the server: the commit metadata from a kernel's description (``quiesce``'s answer or
    the body of ``%snapshot``'s request), checked field by field since a kernel sent it:
    ``{"cell": ..., "variables": ..., "gpu_release": ...}``, each only when present and well
    formed."""
    out: dict = {}
    if not isinstance(info, dict):
        return out
    cell = info.get("cell")
    if isinstance(cell, dict):
        count, source = cell.get("execution_count"), cell.get("source")
        out["cell"] = {"execution_count": count if type(count) is int else None,
                       "source": source[:describe.MAX_SOURCE] if isinstance(source, str) else ""}
    released = _clean_release(info.get("gpu_release"))
    if released:
        out["gpu_release"] = released
    segments = _clean_segments(info.get("gpu_segments"))
    if segments:
        out["gpu_segments"] = segments
    running = _clean_sidecars(info.get("sidecars"))
    if running:
        out["sidecars"] = running
    if info.get("auto") is True:  # an automatic snapshot (autosnap.py)
        out["auto"] = True
    parked = info.get("engines")
    if isinstance(parked, list):
        names = [n[:100] for n in parked[:50] if isinstance(n, str)]
        if names:
            out["engines"] = names  # parked by engines.py for this snapshot
    variables = info.get("variables")
    if isinstance(variables, dict) and isinstance(variables.get("items"), list):
        raw = variables["items"]
        items = [it for it in map(_clean_item, raw[:describe.MAX_ITEMS]) if it is not None]
        out["variables"] = {"items": items,
                            "truncated": bool(variables.get("truncated")) or len(raw) > len(items)}
    return out
