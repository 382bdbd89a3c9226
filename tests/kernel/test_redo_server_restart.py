"""Redo outlives the server (issue 30): undo twice, the server stops (hibernating its idle
kernel, as JupyterHub's culler has it), the next server's kernel for the notebook wakes where
the undo left it and redoes both steps. Meanwhile that server's retention, under a window of one
automatic snapshot, thins what nothing needs but spares the snapshot a redo returns to (it is
no thread's tip: only the redo record names it)."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from kernelkit import Notebook, needs_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from reliakit import ServerProcess, make_base  # noqa: E402

pytestmark = [needs_helper, pytest.mark.timeout(600)]

NB = "undone.ipynb"
SLOW = "time.sleep(1.1)\n"  # a cell of 1 s or more is always snapshotted (below)
AUTO = {"autosnapshot": True, "autosnapshot_after_s": 1.0, "autosnapshot_share": 1e-6}


async def _notebook(server: ServerProcess) -> Notebook:
    nb = Notebook(lambda *a, **k: None, None, NB)  # only its websocket is used here
    nb.kernel_id = server.open_session(NB)
    nb.ws = await server.websocket(nb.kernel_id)
    return nb


def _post(server: ServerProcess, route: str, kernel_id: str) -> tuple[int, dict]:
    code, body = server.request("POST", f"/infinijup/{route}", {"kernel_id": kernel_id})
    return code, body


def _autos(server: ServerProcess, kernel_id: str) -> dict[int, dict]:
    """Automatic snapshots by the cell they followed (execution count)."""
    code, history = server.request("GET", f"/infinijup/history?kernel_id={kernel_id}")
    assert code == 200, history
    return {c["metadata"]["cell"]["execution_count"]: c for c in history["commits"]
            if (c.get("metadata") or {}).get("auto") and (c["metadata"].get("cell") or {})}


async def test_undo_server_restart_redo(helper_daemon):
    base = make_base()
    store = base / "store"
    notebooks = base / "notebooks"
    first = ServerProcess(base / "a", helper_daemon.socket_path, str(store), notebooks,
                          manager_config={**AUTO, "hibernate_on_shutdown": True})
    second = ServerProcess(base / "b", helper_daemon.socket_path, str(store), notebooks,
                           manager_config={**AUTO, "autosnapshot_keep": 1})
    try:
        first.start()
        nb = await _notebook(first)
        await nb.execute("import time", timeout=300)
        counts = []
        for i in (1, 2, 3):
            out = await nb.execute(SLOW + f"x = {i}", timeout=300)
            counts.append(out["reply"]["execution_count"])
        autos = _autos(first, nb.kernel_id)
        c1, c2, c3 = (autos[n]["id"] for n in counts)
        for expected in (2, 1):
            code, moved = _post(first, "undo", nb.kernel_id)
            assert code == 200, moved
            assert await nb.value("x") == expected
        records = list((base / "store-redo").glob("*.json"))
        assert len(records) == 1, records
        assert json.loads(records[0].read_text())["commits"] == [c3, c2]
        nb.ws.close()
        first.stop()  # SIGTERM: the idle kernel is hibernated, the server ends

        second.start()
        nb = await _notebook(second)
        # the first cell wakes the kernel (x as the undo left it) and is snapshotted: the
        # retention pass after it has a window of one
        out = await nb.execute(SLOW + "y = x\nprint(y)", timeout=300)
        assert out["stdout"].split() == ["1"]
        deadline = time.monotonic() + 120
        while not _autos(second, nb.kernel_id)[counts[0]].get("thinned"):  # c1: nothing needs it
            assert time.monotonic() < deadline, "the retention pass did not thin c1"
            await asyncio.sleep(0.1)
        autos = {c["id"]: c for c in _autos(second, nb.kernel_id).values()}
        assert autos[c1].get("thinned") is True
        assert not autos[c2].get("thinned") and not autos[c3].get("thinned")  # redo's, tip

        code, moved = _post(second, "redo", nb.kernel_id)
        assert code == 200, moved
        assert moved["commit"] == c2 and moved["says"].startswith("Redone"), moved
        assert await nb.value("x") == 2
        code, moved = _post(second, "redo", nb.kernel_id)
        assert code == 200 and moved["commit"] == c3, moved
        assert await nb.value("x") == 3
        code, body = _post(second, "redo", nb.kernel_id)
        assert code == 409 and body["reason"] == "nothing_to_redo", body
        assert not list((base / "store-redo").glob("*.json"))  # used up: the record is gone
        nb.ws.close()
    finally:
        first.stop()
        second.stop()
        shutil.rmtree(base, ignore_errors=True)
