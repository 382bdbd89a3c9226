"""The CUDA stage of dump and restore pipelines (see stages.py).

Dump: every process of the tree holding a CUDA context is locked and checkpointed (its VRAM
moves to host memory, so CRIU sees plain memory), CRIU dumps, then (leave running) each is
restored and unlocked. If anything after the suspend fails, ``rollback`` resumes the GPUs:
the kernel never stays CHECKPOINTED. Restore: after CRIU has restored the tree, whose
processes come back CHECKPOINTED, each is restored and unlocked.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from . import cuda_driver as driver
from .cuda_preflight import check, read_nvml
from .proc import read_proc, tree_members
from .retarget import FILES_IMAGE
from .stages import StageBase

log = logging.getLogger(__name__)

LOCK_TIMEOUT_MS = int(os.environ.get("INFINIJUP_CUDA_LOCK_TIMEOUT_MS", "30000"))


def tree_pids(root: int, owner: int | None = None) -> list[int]:
    """Host pids of ``root`` and all its descendants (the caller holds the root: see
    registry.py). With ``owner``, only the processes whose uids are all that owner's, and the
    root: a member running as anyone else is never locked or checkpointed for this caller."""
    pids = tree_members(root)
    if owner is None or owner == 0:
        return pids
    out = [root]
    for pid in pids[1:]:
        info = read_proc(pid)
        if info is not None and all(uid == owner for uid in info.uids):
            out.append(pid)
    return out


def uses_nvidia(pid: int) -> bool:
    """Cheap pre-filter: does the process map the CUDA driver library?"""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


GPU_RESTORED_WHOLE = ("a GPU kernel's memory goes back onto the GPU at once (restored "
                      "whole)")


def images_map_cuda(criu: Any, dir_fd: int) -> bool:
    """Do the dumped processes map the CUDA driver? (then their restore is whole: the
    driver's restore reads every page it saved into the process at once)"""
    for entry in criu.messages(dir_fd, FILES_IMAGE, "FILES", "file_entry"):
        if entry.HasField("reg") and os.path.basename(entry.reg.name).startswith("libcuda.so"):
            return True
    return False


def cuda_pids(root: int, owner: int | None = None) -> list[int]:
    return [
        p
        for p in tree_pids(root, owner)
        if uses_nvidia(p) and driver.state(p) is not driver.CudaState.NONE
    ]


def gpu_summary(pids: list[int], seconds: dict[str, float]) -> dict[str, Any]:
    """What goes into the commit: devices, VRAM per device, fingerprint, phase times."""
    try:
        report = read_nvml()
    except Exception as exc:  # NVML is for the record here; the driver API did the work
        return {"pids": len(pids), "error": str(exc), "phases": seconds}
    usage = report.usage_by_gpu(set(pids))
    return {
        "pids": len(pids),
        "vram_bytes": usage,
        "phases": seconds,
        "fingerprint": report.fingerprint,
    }


class CudaSuspend(StageBase):
    """Before CRIU dump: preflight, then lock + checkpoint every CUDA process of the tree."""

    name = "cuda_checkpoint"

    def __init__(self, root_pid: int | None = None, owner: int | None = None) -> None:
        self.root_pid = root_pid  # None: the dump job's pid
        self.owner = owner  # None: the dump job's caller
        self.suspended: list[int] = []
        self.summary: dict[str, Any] | None = None

    def run(self, ctx: Any) -> None:
        root = self.root_pid if self.root_pid is not None else ctx.pid
        owner = self.owner if self.owner is not None else getattr(
            getattr(ctx, "caller", None), "uid", None)
        pids = cuda_pids(root, owner)
        if not pids:
            return
        t0 = time.monotonic()
        report = read_nvml()
        warnings = check(report, set(tree_pids(root)))
        usage = report.usage_by_gpu(set(pids))
        try:
            for pid in pids:
                driver.suspend(pid, LOCK_TIMEOUT_MS)
                self.suspended.append(pid)
        except BaseException:
            self.resume_all()  # the runner rolls back completed stages only: unwind ourselves
            raise
        self.summary = {
            "pids": len(pids),
            "vram_bytes": usage,
            "warnings": warnings,
            "fingerprint": report.fingerprint,
            "phases": {"checkpoint_s": time.monotonic() - t0},
        }

    def resume_all(self) -> None:
        errors = []
        for pid in self.suspended:
            try:
                driver.resume(pid)
            except Exception as exc:
                errors.append(f"{pid}: {exc}")
        self.suspended = []
        if errors:
            raise driver.CudaError("CUDA resume failed: " + "; ".join(errors))

    def rollback(self, ctx: Any) -> None:
        self.resume_all()


class CudaResumeAfterDump(StageBase):
    """After a leave-running dump: the kernel's GPUs come back and it goes on."""

    name = "cuda_resume"

    def __init__(self, suspend: CudaSuspend) -> None:
        self.suspend = suspend

    def run(self, ctx: Any) -> None:
        if not getattr(ctx, "leave_running", True):
            self.suspend.suspended = []  # CRIU ended the processes: nothing to resume
            return
        t0 = time.monotonic()
        had = bool(self.suspend.suspended)
        self.suspend.resume_all()
        if had and self.suspend.summary is not None:
            self.suspend.summary["phases"]["resume_s"] = time.monotonic() - t0


class CudaResumeRestored(StageBase):
    """After CRIU restore: restore + unlock every process that came back CHECKPOINTED."""

    name = "cuda_restore"

    def __init__(self) -> None:
        self.summary: dict[str, Any] | None = None

    def run(self, ctx: Any) -> None:
        pids = [
            p
            for p in tree_pids(ctx.pid)
            if uses_nvidia(p) and driver.state(p) is driver.CudaState.CHECKPOINTED
        ]
        if not pids:
            return
        t0 = time.monotonic()
        gpu_map = tuple(getattr(ctx, "gpu_map", ()) or ())
        try:
            for pid in pids:
                driver.resume(pid, gpu_map)
        except BaseException:
            # A restored tree whose GPU state cannot come back is of no use: end it, so the
            # caller sees a clean failure rather than a kernel stuck CHECKPOINTED.
            os.kill(ctx.pid, 9)
            raise
        self.summary = {"pids": len(pids), "phases": {"restore_s": time.monotonic() - t0}}


def resume_tree(root: int) -> dict[str, Any]:
    """Bring back onto the GPU every process of the tree that is locked or checkpointed."""
    t0 = time.monotonic()
    pids = [p for p in tree_pids(root) if uses_nvidia(p)
            and driver.state(p) in (driver.CudaState.CHECKPOINTED, driver.CudaState.LOCKED)]
    for pid in pids:
        driver.resume(pid)
    return {"pids": len(pids), "phases": {"restore_s": time.monotonic() - t0}}
