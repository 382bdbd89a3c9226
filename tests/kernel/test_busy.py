"""Busy kernels (issue 28, item 7), through a real server, helper and kernel: every route that
must wait for a running cell answers 409 ``kernel_busy`` past ``busy_timeout`` and leaves the
cell alone; a wait can be cancelled (409 ``cancelled``); and a request given up on does not
quiesce the kernel behind the user's back when the cell ends (or is undone if it did)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from jupyter_client.asynchronous import AsyncKernelClient
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


class OwnClient:
    """A kernel started through the server and driven only through its own connection file
    (iopub is not read: one message there is signed with a wrong key)."""

    def __init__(self, jp_fetch, km) -> None:
        self.fetch, self.km = jp_fetch, km
        self.kc = AsyncKernelClient(connection_file=km.connection_file)
        self.kc.load_connection_file()
        self.kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)

    async def run(self, code: str) -> str:
        """Run ``code``; the value of ``y`` after it."""
        msg_id = self.kc.execute(code, user_expressions={"y": "y"})
        while True:
            reply = await self.kc.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == msg_id:
                assert reply["content"]["status"] == "ok", reply["content"]
                return reply["content"]["user_expressions"]["y"]["data"]["text/plain"]

    async def post(self, route: str, body: dict) -> tuple[int, dict]:
        r = await self.fetch("infinijup", route, method="POST", body=json.dumps(body),
                             request_timeout=600, raise_error=False)
        return r.code, json.loads(r.body)

    async def deafen_the_server(self, caplog) -> None:
        """A cell that sends, between its busy and idle, a message the server cannot verify."""
        assert await self.run("from jupyter_client.session import Session\n"
                              "k = get_ipython().kernel\n"
                              "Session(key=b'not-the-kernel-key').send(k.iopub_socket, 'stream', "
                              "{'name': 'stdout', 'text': 'x'})\ny = 100") == "100"
        while "Invalid Signature" not in caplog.text:
            await asyncio.sleep(0.01)  # the server's reader read it: an uncaught error
        assert self.km.execution_state == "busy"  # and it read nothing after it (the idle)


@pytest.fixture
def own_client(jp_fetch, jp_serverapp, infinijup_kernelspec, jp_asyncio_loop):
    async def start() -> OwnClient:
        r = await jp_fetch("api", "sessions", method="POST", body=json.dumps(
            {"path": "own.ipynb", "type": "notebook", "name": "own.ipynb",
             "kernel": {"name": infinijup_kernelspec}}))
        km = jp_serverapp.kernel_manager.get_kernel(json.loads(r.body)["kernel"]["id"])
        client = OwnClient(jp_fetch, km)
        await client.kc.wait_for_ready(timeout=120)
        return client

    client = jp_asyncio_loop.run_until_complete(start())  # pytest-jupyter's loop (kernelkit)
    yield client
    client.kc.stop_channels()


async def test_a_kernel_whose_idle_the_server_missed_still_moves(own_client, jp_serverapp,
                                                                 tmp_path, caplog):
    """The server's view of a kernel is built from the iopub statuses it read; its reader reads
    nothing more after a message it cannot verify (as a restored kernel's, signed with its old
    key), and any status sent before it subscribed is missed. A kernel driven through its own
    connection file whose idle the server never read is still restored at once: the wait asks
    the kernel, which answers only between cells."""
    me, km = own_client, own_client.km
    manager(jp_serverapp).busy_timeout = 20.0
    await me.run("y = 99")
    code, snap = await me.post("snapshot", {"kernel_id": km.kernel_id})
    assert code == 201, snap
    await me.deafen_the_server(caplog)
    code, body = await me.post("restore", {"kernel_id": km.kernel_id, "commit": snap["commit"]})
    assert code == 200, body
    assert await me.run("y") == "99"
    # the server watches the kernel anew: a cell it did not start shows busy, then idle
    flag = tmp_path / "go"
    cell = asyncio.ensure_future(me.run(f"import os, time\nwhile not os.path.exists("
                                        f"{str(flag)!r}): time.sleep(0.01)"))
    while km.execution_state != "busy":
        await asyncio.sleep(0.01)
    flag.touch()
    assert await cell == "99"
    while km.execution_state != "idle":
        await asyncio.sleep(0.01)


async def test_the_idle_policy_rests_a_kernel_whose_idle_the_server_missed(
        own_client, jp_serverapp, caplog):
    """... and the idle policy asks such a kernel, once it has been quiet for the policy's
    time, whether it is between cells (test_hibernate.py: a busy kernel, asked, is left)."""
    me, km = own_client, own_client.km
    await me.run("y = 99")
    await me.deafen_the_server(caplog)
    m = manager(jp_serverapp)
    m.hibernate_after = 1.0
    await m.hibernation.tick(time.time() + 3600)
    assert m.lifecycle.state(km.kernel_id) == "hibernated"
