"""Dump and restore as ordered lists of stages, so GPU state can be plugged in later.

A dump today is ``[CriuDump, SealImages]``; with CUDA it becomes ``[CudaCheckpoint, CriuDump,
SealImages, CudaResume]`` where ``CudaCheckpoint.rollback`` resumes the GPU if a later stage
fails. A restore is ``[CheckImages, KillReplaced, CriuRestore]`` and would gain ``CudaResume``
after ``CriuRestore``. Each stage reports its own timing as a phase and a progress event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

Progress = Callable[[str, Mapping[str, Any]], None]


class Stage(Protocol):
    """One step of a dump or restore. ``ctx`` is the op's mutable context object."""

    name: str

    def run(self, ctx: Any) -> None:
        """Do the step; raise to abort the whole pipeline."""

    def rollback(self, ctx: Any) -> None:
        """Undo ``run`` after a *later* stage failed (e.g. resume a GPU that was checkpointed)."""


class StageBase:
    """Convenience base: no rollback needed."""

    name = "stage"

    def run(self, ctx: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def rollback(self, ctx: Any) -> None:
        return None


def run_stages(stages: Sequence[Stage], ctx: Any, progress: Progress) -> dict[str, float]:
    """Run stages in order; on failure roll back the completed ones in reverse and re-raise.

    Returns ``{stage name: seconds}`` for the ``phases`` field of the result.
    """
    phases: dict[str, float] = {}
    done: list[Stage] = []
    try:
        for stage in stages:
            progress(stage.name, {"state": "started"})
            start = time.monotonic()
            stage.run(ctx)
            phases[stage.name] = round(time.monotonic() - start, 6)
            progress(stage.name, {"state": "done", "seconds": phases[stage.name]})
            done.append(stage)
    except BaseException:
        for stage in reversed(done):
            try:
                stage.rollback(ctx)
            except Exception:  # noqa: BLE001 - report the original failure, log this one
                log.exception("rollback of stage %s failed", stage.name)
        raise
    return phases
