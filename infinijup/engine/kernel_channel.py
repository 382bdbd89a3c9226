"""Talking to a kernel over its own channels, apart from the notebook's connection.

Two things the engine needs from a kernel: run Infinijup's agent inside it (quiesce before a
snapshot, resume after), and know when a restored kernel answers again. After a restore the
ZMQ sockets reconnect on their own, and the first iopub messages can be lost while a SUB socket
resubscribes, so "answers" means: a kernel_info reply on shell *and* its status on iopub.
"""

from __future__ import annotations

import ast
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from queue import Empty

from ..errors import Conflict, RestoreFailed


async def _shell_reply(kc, msg_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            msg = await kc.get_shell_msg(timeout=left)
        except Empty:
            raise TimeoutError from None
        if msg.get("parent_header", {}).get("msg_id") == msg_id:
            return msg


LATE_WAIT = 600.0  # how long a request given up on is still listened for (see run_agent)
_late: set[asyncio.Task] = set()


async def run_agent(km, expression: str, timeout: float, then_key: bytes | None = None,  # noqa: ANN001
                    late: Callable[[dict], Awaitable[None]] | None = None,
                    cancel: asyncio.Event | None = None) -> dict:
    """Evaluate ``expression`` (returning a JSON string) in the kernel once it is idle.

    The request waits behind any running cell; past ``timeout`` (or once ``cancel`` is set) it
    raises Conflict (409) and the running cell is left alone. ``then_key``: the request is
    signed with the session's key of now, the reply is read with this one (the expression gives
    the kernel a new key).

    A request given up on stays in the kernel's queue and runs when the cell ends. Agent calls
    that change the kernel (quiesce, release) carry a deadline and do nothing past it
    (``{"stale": true}``); for one that started just before, ``late`` gets its answer and
    undoes it (the reply is listened for ``LATE_WAIT`` s more).
    """
    kc = km.client()
    kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    handed_over = False
    try:
        msg_id = kc.execute("", silent=True, store_history=False,
                            user_expressions={"r": expression})
        if then_key is not None:  # signed and queued: what comes back is signed anew
            kc.session.key = then_key
        waiting = asyncio.ensure_future(_shell_reply(kc, msg_id, timeout))
        stop = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
        try:
            await asyncio.wait({waiting} | ({stop} if stop else set()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stop is not None:
                stop.cancel()
        if waiting.done() and not isinstance(waiting.exception(), TimeoutError):
            return _result(waiting.result())  # (or raises what went wrong)
        waiting.cancel()
        if late is not None:
            handed_over = True
            task = asyncio.ensure_future(_late_reply(kc, msg_id, late))
            _late.add(task)
            task.add_done_callback(_late.discard)
        if cancel is not None and cancel.is_set():
            raise Conflict("cancelled while the kernel was busy: the running cell goes on",
                           reason="cancelled")
        raise Conflict(
            f"the kernel stayed busy for {timeout:.0f} s: wait for the running cell to "
            "finish (or interrupt it) and try again",
            reason="kernel_busy",
        )
    finally:
        if not handed_over:
            kc.stop_channels()


def _result(reply: dict) -> dict:
    expr = reply["content"].get("user_expressions", {}).get("r", {})
    if expr.get("status") != "ok":
        return {"error": expr.get("evalue", "agent failed")}
    return json.loads(ast.literal_eval(expr["data"]["text/plain"]))


async def _late_reply(kc, msg_id: str, late: Callable[[dict], Awaitable[None]]) -> None:  # noqa: ANN001
    try:
        result = _result(await _shell_reply(kc, msg_id, LATE_WAIT))
    except Exception:
        return
    finally:
        kc.stop_channels()
    if not result.get("stale"):
        try:
            await late(result)
        except Exception:
            pass


async def wait_answering(km, timeout: float) -> float:
    """Wait until the kernel answers on shell and iopub; return how long it took."""
    t0 = time.monotonic()
    kc = km.client()
    kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
    try:
        while time.monotonic() - t0 < timeout:
            msg_id = kc.kernel_info()
            try:
                await _shell_reply(kc, msg_id, 1.0)
            except (TimeoutError, asyncio.TimeoutError):
                continue
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                try:
                    msg = await kc.get_iopub_msg(timeout=max(0.01, end - time.monotonic()))
                except Exception:
                    break
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    return time.monotonic() - t0
        raise RestoreFailed(f"the restored kernel did not answer within {timeout:.0f} s",
                            reason="restore_unresponsive")
    finally:
        kc.stop_channels()


async def answers_between_cells(km, timeout: float) -> bool:
    """Whether the kernel answers a kernel_info request within ``timeout``. A kernel reads its
    shell requests one at a time, after the running cell ends, so an answer means that no cell
    ran when it was read, whatever the server's view says: that view is built from the iopub
    statuses the server read, and misses those sent before its subscription reached the kernel
    or after a message it could not verify."""
    kc = km.client()
    kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        await _shell_reply(kc, kc.kernel_info(), timeout)
        return True
    except (TimeoutError, asyncio.TimeoutError):
        return False
    finally:
        kc.stop_channels()


def watch_activity_anew(kernel_manager, km) -> None:
    """jupyter_server's activity stream reads nothing more after a message it cannot verify
    (its error leaves the stream's edge-triggered socket unread; such are those a restored
    kernel signed with its snapshot's key before it was adopted): watch the kernel anew. It
    answered, and nothing runs until the restore ends: not "starting" any more."""
    stream = getattr(km, "_activity_stream", None)
    if stream is not None and not stream.closed():
        stream.close()
    km._activity_stream = None
    kernel_manager.start_watching_activity(km.kernel_id)
    if getattr(km, "execution_state", None) == "starting":
        km.execution_state = "idle"
