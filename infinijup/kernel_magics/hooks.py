"""Quiesce and resume hooks that run inside the kernel around a snapshot.

Libraries register a hook to bring their state to a point that is safe to freeze (drain a queue,
synchronize a GPU stream) and to pick up again afterwards::

    from infinijup.kernel_magics import register_quiesce_hook, register_resume_hook
    register_quiesce_hook(my_sync)
    register_resume_hook(lambda restored: reconnect() if restored else None)

Resume hooks receive ``restored``: False when the kernel goes on after its own snapshot, True
when it runs again from a restored snapshot.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from . import engines, gpu_context, gpu_sync, gpu_vmm, sidecars, unsavable

QuiesceHook = Callable[[], object]
ResumeHook = Callable[[bool], object]

_quiesce_hooks: list[QuiesceHook] = []
_resume_hooks: list[ResumeHook] = []


def register_quiesce_hook(hook: QuiesceHook) -> QuiesceHook:
    """Run ``hook()`` before each snapshot of this kernel. Usable as a decorator."""
    if hook not in _quiesce_hooks:
        _quiesce_hooks.append(hook)
    return hook


def register_resume_hook(hook: ResumeHook) -> ResumeHook:
    """Run ``hook(restored)`` after each snapshot and after each restore. Usable as a decorator."""
    if hook not in _resume_hooks:
        _resume_hooks.append(hook)
    return hook


def unregister_hook(hook: Callable) -> None:
    for hooks in (_quiesce_hooks, _resume_hooks):
        if hook in hooks:
            hooks.remove(hook)


def run_quiesce() -> dict:
    """Run every quiesce hook, then release the GPU libraries' unused caches (gpu_sync.py);
    return what they did and how long it took (``gpu_release`` only where one was made)."""
    t0 = time.perf_counter()
    refused = unsavable.why()
    if refused is not None:  # nothing is touched: the server says why, the kernel runs on
        return {"hook_errors": [], "refused": refused[1], "refused_reason": refused[0],
                "quiesce_s": time.perf_counter() - t0}
    # First the engines with loops of their own (engines.py): parked, they launch no more GPU
    # work and change no queue while the hooks below synchronize and the memory moves out.
    parked = engines.pause_all()
    errors = list(parked["errors"])
    for hook in list(_quiesce_hooks):
        try:
            hook()
        except Exception as exc:  # a failing hook must not leave the kernel half-quiesced
            errors.append(f"{getattr(hook, '__name__', hook)}: {exc}")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # Last, once every hook has finished its GPU work: what the GPU libraries cache unused.
    released = gpu_sync.release_cached_memory()
    info: dict = {"hook_errors": errors}
    if parked["parked"]:
        info["engines"] = parked["parked"]
    if released:
        info["gpu_release"] = released
    # Then what is live: PyTorch's segments into the kernel's arena file (gpu_vmm.py)
    try:
        segments = gpu_vmm.offload()
    except Exception as exc:
        segments = {"fallback": f"{type(exc).__name__}: {exc}"}
    if segments:
        info["gpu_segments"] = segments
    # Last of the GPU steps: the contexts' local memory (stack space), which no launch will use
    # until the resume sets it back (gpu_context.py)
    freed = gpu_context.trim()
    if freed:
        info.setdefault("gpu_release", {})["local_memory"] = freed
    try:
        running = sidecars.describe()  # they are in the snapshot with the kernel
    except Exception:
        running = []
    if running:
        info["sidecars"] = running
    info["quiesce_s"] = time.perf_counter() - t0
    return info


def run_resume(restored: bool, segments: str | None = None) -> dict:
    """Bring the GPU segments back (from ``segments``, a restore's copy, or the arena file),
    then run every resume hook."""
    t0 = time.perf_counter()
    errors = gpu_context.restore()  # first: no launch of the copy back may find a stack of 0
    try:
        gpu_vmm.bring_back(restored, segments)
    except Exception as exc:
        errors.append(f"GPU segments: {exc}")
    for hook in list(_resume_hooks):
        try:
            hook(restored)
        except Exception as exc:
            errors.append(f"{getattr(hook, '__name__', hook)}: {exc}")
    errors.extend(engines.resume_all())  # last: their memory and everything else is back
    return {"resume_s": time.perf_counter() - t0, "hook_errors": errors}
