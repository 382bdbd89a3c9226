"""Progress of operations on jupyter_server's event bus (schema ``EVENT_SCHEMA_ID``).

Every snapshot, restore, hibernation, release and wake publishes its phases (queued, quiesce,
dump, store, restore, reconnect, ..., then done or error) with a percentage; the Lab extension
draws them (labextension/src/progress.ts, restState.ts). An event must never break the
operation it tells of.
"""

from __future__ import annotations

import asyncio

from ..engine.lifecycle import Operation

EVENT_SCHEMA_ID = "https://events.infinijup.dev/operation"

# The percentage of an engine phase that gives none of its own
PHASE_PERCENT = {"dump": 40, "store": 70, "kill": 30, "restore": 60, "gpu": 20}

# The helper's stages (infinijup_helper: checkpoint.py, cuda_stage.py, host_files.py,
# retarget.py) within the operation's phases, which are all the event schema knows: a stage
# reported under its own name would fail validation and never reach the UI.
STAGE_PHASE = {"verify": "dump", "publish": "dump", "cuda_checkpoint": "gpu",
               "cuda_resume": "dump", "stage": "restore", "files": "restore",
               "retarget": "restore", "cuda_restore": "restore"}


class Events:
    def __init__(self, serverapp, log) -> None:  # noqa: ANN001
        self.serverapp, self.log = serverapp, log

    def emit(self, op: Operation, phase: str, percent: float, step: str | None = None,
             **extra) -> None:
        """``step``: the helper's stage within ``phase``, shown by the status as the phase."""
        op.phase, op.percent = step or phase, percent
        op.commit = extra.get("commit") or op.commit
        op.reason = extra.get("reason") or op.reason
        data = {"op": op.op, "op_id": op.op_id, "kernel_id": op.kernel_id, "path": op.path,
                "phase": phase, "percent": float(percent)}
        data.update({k: str(v) for k, v in extra.items() if v is not None})
        if op.quiet:
            data["quiet"] = True
        try:
            self.serverapp.event_logger.emit(schema_id=EVENT_SCHEMA_ID, data=data)
        except Exception as exc:  # progress must never break an operation
            self.log.debug("infinijup: event not emitted: %s", exc)

    def end(self, op: Operation, phase: str, **extra) -> None:
        """``done`` or ``error`` (100%), or a first ``queued`` (0%)."""
        self.emit(op, phase, 100 if phase in ("done", "error") else 0, **extra)

    def failed(self, op: Operation, exc: BaseException, **extra) -> None:
        self.emit(op, "error", 100, message=getattr(exc, "message", str(exc)),
                  reason=getattr(exc, "reason", "error"), **extra)

    def progress(self, op: Operation):
        """A progress callback for the engine, safe to call from its worker threads."""
        loop = asyncio.get_running_loop()

        def report(phase: str, detail: dict) -> None:
            def emit() -> None:  # on the loop, which keeps op.percent
                if phase in STAGE_PHASE:  # a step within a phase: the bar stays where it is
                    self.emit(op, STAGE_PHASE[phase], detail.get("percent", op.percent),
                              step=phase, message=detail.get("message"))
                else:
                    self.emit(op, phase, detail.get("percent", PHASE_PERCENT.get(phase, op.percent)),
                              message=detail.get("message"))

            loop.call_soon_threadsafe(emit)

        return report
