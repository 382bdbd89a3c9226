"""Busy kernels (issue 28, item 7), through a real server, helper and kernel: every route that
must wait for a running cell answers 409 ``kernel_busy`` past ``busy_timeout`` and leaves the
cell alone; a wait can be cancelled (409 ``cancelled``); and a request given up on does not
quiesce the kernel behind the user's back when the cell ends (or is undone if it did)."""

from __future__ import annotations

import asyncio
import json

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(300)]

HOOKS = """
from infinijup.kernel_magics import register_quiesce_hook, register_resume_hook
calls = []
register_quiesce_hook(lambda: calls.append('quiesce'))
register_resume_hook(lambda restored: calls.append('resume'))
import os, time
"""


def manager(jp_serverapp):
    return jp_serverapp.web_app.settings["infinijup_manager"]


async def busy_cell(nb, jp_serverapp, flag) -> str:
    """A cell that runs until ``flag`` exists; returns its msg id once the kernel is busy."""
    cell = nb.send_execute(f"while not os.path.exists({str(flag)!r}): time.sleep(0.01)\n"
                           "print('finished')")
    km = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id)
    while km.execution_state != "busy":
        await asyncio.sleep(0.01)
    return cell


async def test_every_route_answers_409_past_busy_timeout(notebook, jp_serverapp, tmp_path):
    nb = notebook
    await nb.execute(HOOKS)
    snap = await nb.snapshot(message="before")
    await nb.execute("calls.clear()")
    flag = tmp_path / "go"
    cell = await busy_cell(nb, jp_serverapp, flag)
    manager(jp_serverapp).busy_timeout = 0.5
    routes = {"snapshot": {}, "hibernate": {}, "release": {},
              "restore": {"commit": snap["commit"]}}
    for route, extra in routes.items():
        r = await nb.post(route, {"kernel_id": nb.kernel_id, **extra})
        body = json.loads(r.body)
        assert r.code == 409 and body["reason"] == "kernel_busy", (route, r.code, r.body)
        assert "try again" in body["message"], (route, body)
    flag.touch()
    out = await nb.collect(cell)
    assert out["stdout"] == "finished\n" and out["reply"]["status"] == "ok"
    # the quiesce the snapshot queued behind the cell ran after its deadline: it did nothing
    assert await nb.value("calls") == []
    status = json.loads((await nb.fetch("infinijup", "status",
                                        params={"kernel_id": nb.kernel_id})).body)
    assert status["state"] == "running", status


async def test_a_wait_can_be_cancelled_and_a_late_quiesce_is_undone(notebook, jp_serverapp,
                                                                    tmp_path):
    nb = notebook
    await nb.execute(HOOKS)
    flag = tmp_path / "go"
    cell = await busy_cell(nb, jp_serverapp, flag)
    manager(jp_serverapp).busy_timeout = 600.0  # only the cancel ends these waits
    m = manager(jp_serverapp)
    snapshot = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    hibernate = asyncio.ensure_future(nb.post("hibernate", {"kernel_id": nb.kernel_id}))
    # both wait: the snapshot for its quiesce behind the cell, the hibernation for idle
    while not (m.lifecycle.operation(nb.kernel_id) and m._busy_waits.get(nb.kernel_id)):
        await asyncio.sleep(0.01)
    r = await nb.post("cancel", {"kernel_id": nb.kernel_id})
    assert r.code == 200 and json.loads(r.body)["cancelled"] == 2, r.body
    for answer in await asyncio.gather(snapshot, hibernate):
        assert answer.code == 409 and json.loads(answer.body)["reason"] == "cancelled", \
            answer.body
    assert not (await nb.history())["commits"]
    # the cell goes on; when it ends, the snapshot's quiesce (queued, within its deadline)
    # runs, and the server, which gave up on it, undoes it at once: the resume hooks run
    flag.touch()
    out = await nb.collect(cell)
    assert out["reply"]["status"] == "ok"
    for _ in range(3000):
        if await nb.value("len(calls)") >= 2:
            break
        await asyncio.sleep(0.01)
    assert await nb.value("calls") == ["quiesce", "resume"]
    # and the kernel snapshots normally afterwards
    snap = await nb.snapshot(message="after")
    assert snap["commit"]
