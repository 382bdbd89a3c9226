"""An automatic snapshot's images are stored at a lower CPU priority (issue 30), so that the
kernel's next cells come first: held at the store's hold point before the ingest
(``INFINIJUP_STORE_HOLDS``, infinijup/store/faults.py), the thread storing it is the niced one
(engine/niced.py), ``autosnapshot_ingest_nice`` levels below the server's; a snapshot the user
asked for is stored at the server's own priority. Released, both are in the store, and the
automatic one restores. The server runs in this process, so its threads are this process's.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
from kernelkit import needs_helper

from infinijup.engine.niced import MAX_NICE, THREAD_NAME

pytestmark = [needs_helper, pytest.mark.timeout(300)]

NICE = 7
SLOW = "time.sleep(1.1)\n"  # at least autosnapshot_after_s: always snapshotted


@pytest.fixture
def jp_server_config(jp_server_config):
    manager = {**jp_server_config["SnapshotManager"], "autosnapshot": True,
               "autosnapshot_after_s": 1.0, "autosnapshot_share": 1e-6,
               "autosnapshot_ingest_nice": NICE}
    return {**jp_server_config, "SnapshotManager": manager}


@pytest.fixture
def ingest_hold(tmp_path, monkeypatch):
    holds = tmp_path / "store-holds"
    holds.mkdir()
    monkeypatch.setenv("INFINIJUP_STORE_HOLDS", str(holds))
    point = holds / "before_ingest"
    yield point
    point.unlink(missing_ok=True)


async def until(ok, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        await asyncio.sleep(0.02)


async def reached(point: Path) -> None:
    done = point.with_name(point.name + ".reached")
    await until(done.exists, f"arrival at {point.name}")
    done.unlink()


def niced_threads() -> dict[int, int]:
    """This process's threads named as run_niced names them: tid -> nice value."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() != THREAD_NAME:
                    continue
            out[int(task)] = os.getpriority(os.PRIO_PROCESS, int(task))
        except OSError:  # a thread that ended meanwhile
            continue
    return out


async def test_an_automatic_snapshot_is_stored_niced(notebook, ingest_hold):
    nb = notebook
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert mine + 1 <= MAX_NICE, "this test needs a server below the largest nice value"
    await nb.execute("import time")
    ingest_hold.touch()
    # the cell returns once its kernel is dumped; the ingest waits at the hold point
    await nb.execute(SLOW + "x = 'automatic'")
    await reached(ingest_hold)
    assert list(niced_threads().values()) == [min(MAX_NICE, mine + NICE)]
    assert await nb.value("x") == "automatic"  # the kernel runs on meanwhile
    ingest_hold.unlink()
    await until(lambda: not niced_threads(), "end of the niced ingest")
    commits = (await nb.history())["commits"]
    auto = [c for c in commits if (c.get("metadata") or {}).get("auto")]
    assert len(auto) == 1, commits

    # a snapshot the user asked for: stored at the server's priority
    await nb.execute("x = 'later'")
    ingest_hold.touch()
    asked = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id,
                                                       "message": "mine"}))
    await reached(ingest_hold)
    assert niced_threads() == {}
    ingest_hold.unlink()
    r = await asked
    assert r.code == 201, r.body
    assert json.loads(r.body)["parents"] == [auto[0]["id"]]

    await nb.restore(auto[0]["id"])
    assert await nb.value("x") == "automatic"
