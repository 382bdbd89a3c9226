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


async def run_agent(km, expression: str, timeout: float, then_key: bytes | None = None) -> dict:
    """Evaluate ``expression`` (returning a JSON string) in the kernel once it is idle.

    The request waits behind any running cell; past ``timeout`` it raises Conflict (409) and the
    running cell is left alone. ``then_key``: the request is signed with the session's key of
    now, the reply is read with this one (the expression gives the kernel a new key).
    """
    kc = km.client()
    kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        msg_id = kc.execute("", silent=True, store_history=False,
                            user_expressions={"r": expression})
        if then_key is not None:  # signed and queued: what comes back is signed anew
            kc.session.key = then_key
        try:
            reply = await _shell_reply(kc, msg_id, timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise Conflict(
                f"the kernel stayed busy for {timeout:.0f} s: wait for the running cell to "
                "finish (or interrupt it) and try again",
                reason="kernel_busy",
            ) from None
        expr = reply["content"].get("user_expressions", {}).get("r", {})
        if expr.get("status") != "ok":
            return {"error": expr.get("evalue", "agent failed")}
        return json.loads(ast.literal_eval(expr["data"]["text/plain"]))
    finally:
        kc.stop_channels()


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


def watch_activity_anew(kernel_manager, km) -> None:
    """jupyter_server's activity stream closes on the first message it cannot verify (those a
    restored kernel signed with its snapshot's key before it was adopted): watch the kernel
    anew. It answered, and nothing runs until the restore ends: not "starting" any more."""
    stream = getattr(km, "_activity_stream", None)
    if stream is not None and not stream.closed():
        stream.close()
    km._activity_stream = None
    kernel_manager.start_watching_activity(km.kernel_id)
    if getattr(km, "execution_state", None) == "starting":
        km.execution_state = "idle"
