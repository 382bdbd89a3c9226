"""A snapshot taken from inside the kernel: ``%snapshot`` and the automatic snapshots.

The kernel runs its quiesce hooks, describes itself (the cell, the variables), asks the server
and waits in this call while the helper dumps it; the answer comes once it is dumped (the store
then takes the images in) or, with ``wait``, once the store holds the commit. A kernel restored
from this snapshot resumes here, in the same wait, and goes on from the same answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from . import describe, hooks
from .server_client import ServerError, kernel_id, request, wait_result

SNAPSHOT_TIMEOUT_S = 3600.0
# A kernel restored from its own snapshot wakes in the same wait: a wait this much longer than
# the dump's pause was a restore, not the snapshot's cost
RESTORED_AFTER_S = 60.0
# The server refuses for now, not for good: the kernel is being moved (hibernated, restored,
# snapshotted by someone else), or asked to wait
REFUSED_FOR_NOW = ("operation_running", "kernel_hibernated", "kernel_busy", "cancelled")


class SnapshotRefused(ServerError):
    """The server cannot take this snapshot now (see ``REFUSED_FOR_NOW``)."""


def take(shell, *, message: str = "", thread: str | None = None, wait: bool = False,  # noqa: ANN001
         auto: bool = False, skip_if: Callable[[dict], bool] | None = None) -> dict | None:
    """Snapshot this kernel; the server's answer plus ``request_id``. ``skip_if(description)``
    True: nothing is taken (None), before any quiesce hook runs."""
    t0 = time.perf_counter()
    described = False
    metadata: dict = {}
    if skip_if is not None:  # described first: a cell that changed nothing costs no quiesce
        try:
            metadata = describe.describe(shell)
            described = True
        except Exception:
            metadata = {}
        if described and skip_if(metadata):
            describe.forget()
            return None
    quiesced = hooks.run_quiesce()
    try:
        if quiesced.get("refused"):  # nothing was touched (unsavable.py): say why, go on
            raise ServerError(422, quiesced["refused"], quiesced.get("refused_reason", "refused"))
        request_id = uuid.uuid4().hex
        body = {
            "kernel_id": kernel_id(), "message": message, "from_kernel": True,
            # the running cell's number (IPython has already moved the count past it)
            "request_id": request_id, "execution_count": shell.execution_count - 1,
        }
        if not described:
            try:
                metadata = describe.describe(shell)
                described = True
            except Exception:  # a commit without a description rather than no commit
                metadata = {}
        body["metadata"] = dict(metadata)
        if auto:
            body["metadata"]["auto"] = True
        for key in ("gpu_release", "gpu_segments", "sidecars", "engines"):
            if quiesced.get(key):
                body["metadata"][key] = quiesced[key]
        if thread:
            body["thread"] = thread
        request("POST", "/infinijup/snapshot", body)
        result = wait_result(request_id, SNAPSHOT_TIMEOUT_S, dumped=not wait)
        if "error" in result:
            err = result["error"]
            raise ServerError(0, err.get("message", "unknown error"), err.get("reason", "error"))
    except ServerError as err:
        if described:
            describe.forget()
        if err.status == 409 or err.reason in REFUSED_FOR_NOW:
            raise SnapshotRefused(err.status, str(err), err.reason) from None
        raise
    finally:
        hooks.run_resume(False)
    if "commit" in result:
        describe.committed()
    # what the cell waited: describing, quiescing, asking, the dump (longer than the frozen
    # time the server reports as pause_s); the next automatic snapshot is predicted from it
    held_s = time.perf_counter() - t0
    pause_s = (result.get("stats") or {}).get("pause_s")
    if isinstance(pause_s, (int, float)) and held_s > pause_s + RESTORED_AFTER_S:
        held_s = float(pause_s)  # restored from this snapshot: that wait was the store's
    from .autosnap import noted_pause

    noted_pause(held_s)
    return {**result, "request_id": request_id, "held_s": held_s}
