"""Hibernation (issue 14), through a real server, helper, CRIU and the notebook's own websocket:
a hibernated kernel has no process left; the next request wakes it from its snapshot, requests
sent meanwhile are answered in order, each once; a busy kernel is never hibernated; a wake that
fails answers with the reason and the kernel stays resumable."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import numpy as np
import psutil
import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(600)]

SETUP = ("import random, numpy as np\n"
         "x = 41\nrandom.seed(3)\nrng = np.random.default_rng(5)\nruns = []")


def manager(jp_serverapp):
    return jp_serverapp.web_app.settings["infinijup_manager"]


def root_of(jp_serverapp, kernel_id):
    return jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner.root_pid


async def state_of(nb) -> str:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)["state"]


async def hibernate(nb) -> dict:
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    return json.loads(r.body)


async def answers(nb, msg_ids: list[str], timeout: float = 300) -> dict[str, dict]:
    """Every message of several requests sent at once: {msg_id: {stdout, error, reply,
    order}}, ``order`` being the position of its execute_reply among all replies. Done when
    each has its reply and its idle status (a request that could not run gets both too: a
    notebook needs both to mark the cell done)."""
    out = {m: {"stdout": "", "error": None, "reply": None, "order": None, "idle": False}
           for m in msg_ids}
    replies = 0
    deadline = time.monotonic() + timeout

    def complete(v: dict) -> bool:
        return v["reply"] is not None and v["idle"]

    while not all(complete(v) for v in out.values()):
        raw = await asyncio.wait_for(nb.ws.read_message(), deadline - time.monotonic())
        assert raw is not None, "the kernel websocket closed"
        msg = json.loads(raw)
        parent = msg.get("parent_header", {}).get("msg_id")
        if parent not in out:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out[parent]["stdout"] += content["text"]
        elif kind == "error":
            out[parent]["error"] = f"{content['ename']}: {content['evalue']}"
        elif kind == "execute_reply":
            assert out[parent]["reply"] is None, f"two replies to {parent}"
            out[parent]["reply"], out[parent]["order"] = content, replies
            replies += 1
        elif kind == "status" and content["execution_state"] == "idle":
            out[parent]["idle"] = True
    return out


async def test_hibernated_kernel_has_no_process_and_wakes_on_the_next_cells(
        notebook, jp_serverapp):
    nb = notebook
    await nb.execute(SETUP)
    old_root = root_of(jp_serverapp, nb.kernel_id)
    done = await hibernate(nb)
    assert done["state"] == "hibernated"
    assert await state_of(nb) == "hibernated"
    # no process: the tree is gone, the kernel is still the server's, with the same id
    assert root_of(jp_serverapp, nb.kernel_id) is None
    assert not psutil.pid_exists(old_root)
    # alive to jupyter_client, so its restarter does not start a fresh kernel in its place
    km = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id)
    assert km.has_kernel and await km.is_alive()
    r = await nb.fetch("api", "kernels", nb.kernel_id)
    assert json.loads(r.body)["id"] == nb.kernel_id
    history = await nb.history()
    assert done["commit"] in {c["id"] for c in history["commits"]}

    # five cells at once: the first wakes the kernel; all run, in order, once each
    ids = [nb.send_execute(f"runs.append({i}); print(len(runs), x, random.random(), "
                           f"float(rng.random()))") for i in range(5)]
    got = await answers(nb, ids)
    py, npr = random.Random(3), np.random.default_rng(5)
    for i, msg_id in enumerate(ids):
        assert got[msg_id]["error"] is None, got[msg_id]
        assert got[msg_id]["order"] == i
        assert got[msg_id]["reply"]["status"] == "ok"
        assert got[msg_id]["stdout"].split() == [str(i + 1), "41", repr(py.random()),
                                                 repr(float(npr.random()))]
    counts = [got[m]["reply"]["execution_count"] for m in ids]
    assert counts == list(range(counts[0], counts[0] + 5))
    assert await state_of(nb) == "running"
    assert await nb.value("runs") == [0, 1, 2, 3, 4]
    assert psutil.pid_exists(root_of(jp_serverapp, nb.kernel_id))


async def test_hibernation_adds_a_commit_only_when_the_kernel_changed(notebook, jp_serverapp):
    """Issue 28, item 6: a kernel unchanged since its snapshot sleeps in a snapshot kept aside
    (no commit of the history) and wakes onto the same head; a changed one is recorded."""
    nb = notebook
    await nb.execute("d = {'scores': [1, 2, 3]}\nx = 5")
    snap = await nb.snapshot(message="mine")
    repo = manager(jp_serverapp).repo()
    aside = f"hibernated--{nb.kernel_id}"

    done = await hibernate(nb)
    assert done["recorded"] is False and done["commit"] != snap["commit"]
    assert repo.threads()[aside] == done["commit"]
    history = await nb.history()
    assert [c["id"] for c in history["commits"]] == [snap["commit"]]
    assert history["head"]["commit"] == snap["commit"]
    assert await nb.value("d['scores'] + [x]") == [1, 2, 3, 5]  # wakes it
    history = await nb.history()
    assert history["head"] == {"thread": "main", "commit": snap["commit"],
                               "next_thread": "main"}
    assert aside not in repo.threads()  # awake: gc may take the snapshot kept aside

    # a change made in place since the snapshot: this hibernation is a commit of the history
    await nb.execute("d['scores'].append(4)")
    done = await hibernate(nb)
    assert done["recorded"] is True
    history = await nb.history()
    assert [c["id"] for c in history["commits"]] == [done["commit"], snap["commit"]]
    assert history["head"]["commit"] == done["commit"]
    assert await nb.value("d['scores']") == [1, 2, 3, 4]
    assert aside not in repo.threads()


async def test_a_busy_kernel_is_never_hibernated(notebook, jp_serverapp, tmp_path):
    nb = notebook
    flag = tmp_path / "go"
    await nb.execute("import os, time")
    cell = nb.send_execute(f"while not os.path.exists({str(flag)!r}): time.sleep(0.01)\n"
                           "print('finished')")
    while jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).execution_state != "busy":
        await asyncio.sleep(0.01)
    manager(jp_serverapp).busy_timeout = 0.5  # the cell runs until the flag: any wait ends busy
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 409 and json.loads(r.body)["reason"] == "kernel_busy", r.body
    # the idle policy, however long the "idle" time, leaves a busy kernel alone
    hib = manager(jp_serverapp).hibernation
    manager(jp_serverapp).hibernate_after = 1.0
    await hib.tick(time.time() + 3600)
    assert await state_of(nb) == "running"
    flag.touch()
    out = await nb.collect(cell)
    assert out["stdout"] == "finished\n" and out["reply"]["status"] == "ok"
    # once idle (as the server sees it), the same policy hibernates it
    manager(jp_serverapp).busy_timeout = 60.0
    while jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).execution_state != "idle":
        await asyncio.sleep(0.01)
    await hib.tick(time.time() + 3600)
    assert await state_of(nb) == "hibernated"
    assert await nb.value("x if 'x' in dir() else 'no x'") == "no x"
    assert await state_of(nb) == "running"


async def test_a_failed_wake_answers_with_the_reason_and_a_later_one_works(
        notebook, jp_serverapp, monkeypatch):
    nb = notebook
    await nb.execute("x = 7\nruns = []")
    await hibernate(nb)
    socket = os.environ["INFINIJUP_HELPER_SOCKET"]
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", "/nonexistent/helper.sock")  # helper gone
    first = nb.send_execute("runs.append('first')")
    got = await answers(nb, [first])
    assert got[first]["reply"]["status"] == "error"
    assert "could not wake" in got[first]["error"], got[first]
    assert await state_of(nb) == "hibernated"
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", socket)  # the helper is back
    second = nb.send_execute("runs.append('second'); print(x, runs)")
    got = await answers(nb, [second])
    assert got[second]["reply"]["status"] == "ok", got[second]
    # the failed request never ran; the second ran once, on the hibernated state
    assert got[second]["stdout"] == "7 ['second']\n"


async def test_percent_hibernate_waits_for_its_cell_then_the_idle_ticker_is_not_needed(
        notebook, jp_serverapp):
    nb = notebook
    await nb.execute("y = 'kept'")
    out = await nb.execute("%hibernate")
    assert "hibernates once this cell is done" in out["stdout"]
    deadline = time.monotonic() + 300
    while await state_of(nb) != "hibernated":
        assert time.monotonic() < deadline, "the kernel did not hibernate after %hibernate"
        await asyncio.sleep(0.1)
    assert root_of(jp_serverapp, nb.kernel_id) is None
    assert await nb.value("y") == "kept"


def records_of(jp_serverapp) -> list:
    return list(manager(jp_serverapp).hibernation.records.glob("*.json"))


async def test_restart_or_shutdown_of_a_hibernated_kernel_discards_it(
        notebook, jp_serverapp):
    nb = notebook
    await nb.execute("x = 3")
    await hibernate(nb)
    assert len(records_of(jp_serverapp)) == 1
    # a restart: a fresh kernel, the hibernation forgotten (its snapshot stays in the history)
    await nb.restart()
    assert await state_of(nb) == "running" and not records_of(jp_serverapp)
    assert await nb.value("'x' in dir()") is False
    commits = (await nb.history())["commits"]
    assert [c["message"] for c in commits] == ["hibernated (asked)"]
    # a shutdown of a hibernated kernel: nothing left, no record, no process
    await hibernate(nb)
    assert len(records_of(jp_serverapp)) == 1
    r = await nb.fetch("api", "kernels", nb.kernel_id, method="DELETE")
    assert r.code == 204
    assert not records_of(jp_serverapp)
    assert nb.kernel_id not in jp_serverapp.kernel_manager.list_kernel_ids()
    nb.kernel_id = ""  # closed already


async def test_a_wake_racing_a_second_hibernation_one_wins_cleanly(notebook, jp_serverapp):
    nb = notebook
    await nb.execute("n = 0")
    await hibernate(nb)
    cell = nb.send_execute("n += 1; print(n)")
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})  # while the cell wakes it
    body = json.loads(r.body)
    # either the hibernation came first (it is hibernated already: nothing to do) or the
    # wake did (409, the kernel is waking); never both, never a lost or doubled cell
    assert (r.code, body.get("state") or body.get("reason")) in {
        (200, "hibernated"), (409, "kernel_waking")}, (r.code, body)
    got = await answers(nb, [cell])
    assert got[cell]["reply"]["status"] == "ok" and got[cell]["stdout"] == "1\n", got[cell]
    assert await state_of(nb) == "running"
    assert await nb.value("n") == 1


async def test_the_server_status_lists_every_kernel_and_where_its_gpu_memory_is(notebook):
    nb = notebook
    await nb.execute("x = 1")

    async def listed() -> dict:
        r = await nb.fetch("infinijup", "status")
        return {k["kernel_id"]: k for k in json.loads(r.body)["kernels"]}

    mine = (await listed())[nb.kernel_id]
    # a CPU kernel: no GPU memory anywhere (the GPU figures are tests/kernel/test_gpu_idle.py's)
    assert mine == {"kernel_id": nb.kernel_id, "path": "story.ipynb", "state": "running",
                    "gpu": None}
    await hibernate(nb)
    assert (await listed())[nb.kernel_id]["state"] == "hibernated"
    assert await nb.value("x") == 1


async def test_a_cell_right_after_a_restore_of_a_hibernated_kernel_gets_its_output(
        notebook, jp_serverapp, monkeypatch):
    """The websocket's IOPub reconnects to a new process on its own timer (here every 3 s):
    a cell sent right after a restore of a hibernated kernel waits until it has, or its
    output and idle status would go to nobody (the restore itself had no connection of the
    kernel's to wait for)."""
    import uuid

    import zmq

    nb = notebook
    km = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id)
    connect_iopub = km.connect_iopub

    def slowly_reconnecting_iopub(identity=None):  # noqa: ANN001, ANN202
        km.context.setsockopt(zmq.RECONNECT_IVL, 3000)  # (pyzmq: for new sockets)
        try:
            return connect_iopub(identity=identity)
        finally:
            km.context.sockopts.pop(zmq.RECONNECT_IVL, None)

    monkeypatch.setattr(km, "connect_iopub", slowly_reconnecting_iopub)
    nb.ws.close()  # a websocket whose IOPub is such
    nb.session = uuid.uuid4().hex
    nb.ws = await nb.ws_fetch("api", "kernels", nb.kernel_id, "channels",
                              params={"session_id": nb.session})
    await nb.execute("x = 1", timeout=60)
    snap = await nb.snapshot(message="x is 1")
    await nb.execute("x = 2")
    await hibernate(nb)
    r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": snap["commit"]})
    assert r.code == 200, r.body
    out = await nb.execute("print(x)", timeout=60)
    assert out["stdout"] == "1\n", out
