"""A hibernated kernel stays asleep for what needs no computation (issue 28).

JupyterLab sends a notebook's kernel requests on every tab switch (kernel_info, comm_info, the
debugger's debugInfo): each is answered from what the kernel last said while awake, and the
kernel stays hibernated, with no process. A request that needs the kernel wakes it. Real server,
helper and CRIU, through the notebook's own websocket."""

from __future__ import annotations

import json
import time

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(600)]


def provisioner(jp_serverapp, kernel_id):
    return jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner


async def state_of(nb) -> str:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)["state"]


async def ask(nb, msg_type: str, content: dict, channel: str = "shell",
              timeout: float = 60) -> dict:
    """Send one request on the notebook's websocket; its reply's content once idle again."""
    import asyncio

    msg = nb._msg(msg_type, content, channel)
    nb.ws.write_message(json.dumps(msg))
    reply, idle = None, False
    deadline = time.monotonic() + timeout
    while reply is None or not idle:
        raw = await asyncio.wait_for(nb.ws.read_message(), deadline - time.monotonic())
        assert raw is not None, "the kernel websocket closed"
        got = json.loads(raw)
        if got.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
            continue
        if got["msg_type"] == msg_type.replace("_request", "_reply"):
            reply = got["content"]
        elif got["msg_type"] == "status" and got["content"]["execution_state"] == "idle":
            idle = True
    return reply


DEBUG_INFO = {"type": "request", "command": "debugInfo", "arguments": {}}


async def test_requests_that_need_no_computation_leave_a_hibernated_kernel_asleep(
        notebook, jp_serverapp):
    nb = notebook
    await nb.execute("x = 41")
    awake = {
        "kernel_info": await ask(nb, "kernel_info_request", {}),
        "comm_info": await ask(nb, "comm_info_request", {}),
        "debug": await ask(nb, "debug_request", {**DEBUG_INFO, "seq": 1}, "control"),
    }
    assert awake["kernel_info"]["status"] == "ok" and awake["debug"]["success"] is True
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 200 and json.loads(r.body)["state"] == "hibernated", r.body
    prov = provisioner(jp_serverapp, nb.kernel_id)
    assert prov.tracked is None  # no process at all

    for _ in range(3):  # a user switching between notebook tabs, again and again
        assert await ask(nb, "kernel_info_request", {}) == awake["kernel_info"]
        assert await ask(nb, "comm_info_request", {}) == awake["comm_info"]
        asleep = await ask(nb, "debug_request", {**DEBUG_INFO, "seq": 7}, "control")
        assert asleep == {**awake["debug"], "request_seq": 7}
        assert await ask(nb, "interrupt_request", {}, "control") == {"status": "ok"}
        assert await state_of(nb) == "hibernated"
        assert prov.tracked is None and prov.launches == 1  # nothing was restored or started

    # a request that needs the kernel wakes it, with its state
    assert await nb.value("x") == 41
    assert await state_of(nb) == "running"


async def test_what_the_kernel_never_said_waits_for_it_and_the_rest_wakes_it(
        notebook, jp_serverapp):
    nb = notebook
    await nb.execute("y = 7")
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    # never asked while awake: the debugger's question is not answered from a guess; it is a
    # request for the kernel, which wakes to answer it
    answer = await ask(nb, "debug_request", {**DEBUG_INFO, "seq": 2}, "control", timeout=300)
    assert answer["command"] == "debugInfo" and answer["success"] is True
    assert await state_of(nb) == "running"
    assert await nb.value("y") == 7
