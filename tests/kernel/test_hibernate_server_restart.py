"""A hibernated kernel outlives its server (issue 14): a server with ``hibernate_on_shutdown``
is stopped (SIGTERM, as JupyterHub's idle culler does); its idle kernel is snapshotted and a
record kept; the next server's new kernel for the notebook wakes, on the notebook's first cell,
with the state the old one had."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
from kernelkit import Notebook, needs_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from reliakit import ServerProcess, make_base  # noqa: E402

pytestmark = [needs_helper, pytest.mark.timeout(600)]

NB = "sleepy.ipynb"


async def _notebook(server: ServerProcess) -> Notebook:
    nb = Notebook(lambda *a, **k: None, None, NB)  # only its websocket is used here
    nb.kernel_id = server.open_session(NB)
    nb.ws = await server.websocket(nb.kernel_id)
    return nb


async def test_hibernated_at_shutdown_wakes_in_the_next_server(helper_daemon):
    from infinijup.store import Repository

    base = make_base()
    store = base / "store"
    notebooks = base / "notebooks"
    first = ServerProcess(base / "a", helper_daemon.socket_path, str(store), notebooks,
                          manager_config={"hibernate_on_shutdown": True})
    second = ServerProcess(base / "b", helper_daemon.socket_path, str(store), notebooks)
    try:
        first.start()
        nb = await _notebook(first)
        await nb.execute("import random\nrandom.seed(4)\nx = 41", timeout=300)
        code, snap = first.request("POST", "/infinijup/snapshot",
                                   {"kernel_id": nb.kernel_id, "message": "mine"})
        assert code == 201, snap
        nb.ws.close()
        first.stop()  # SIGTERM: the server hibernates its idle kernel, then ends it

        records = list((base / "store-hibernated").glob("*.json"))
        assert len(records) == 1, records
        record = json.loads(records[0].read_text())
        assert record["path"] == NB
        commit = Repository.open_or_init(store).get_commit(record["commit"])
        assert commit.message == "hibernated (server stopping)"
        # unchanged since "mine": kept aside, and the record says where the kernel stood
        assert list(commit.parents) == [snap["commit"]] and record["head"]["commit"] == snap["commit"]

        second.start()
        nb = await _notebook(second)
        out = await nb.execute("print(x + 1, random.random())", timeout=300)
        assert out["stdout"].split() == ["42", repr(random.Random(4).random())]
        assert not list((base / "store-hibernated").glob("*.json"))  # woken: record gone
        code, status = second.request("GET", f"/infinijup/status?kernel_id={nb.kernel_id}")
        assert code == 200 and status["state"] == "running", status
        code, history = second.request("GET", f"/infinijup/history?kernel_id={nb.kernel_id}")
        assert code == 200 and [c["id"] for c in history["commits"]] == [snap["commit"]]
        assert history["head"]["commit"] == snap["commit"], history["head"]
        nb.ws.close()
    finally:
        first.stop()
        second.stop()
        shutil.rmtree(base, ignore_errors=True)
