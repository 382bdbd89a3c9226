"""The kernel runs again once it is dumped; the store takes the images in meanwhile.

Held at the store's hold point before the ingest (``INFINIJUP_STORE_HOLDS``,
infinijup/store/faults.py), never after a delay: the kernel has had its resume hooks and
answers executes, ``%snapshot`` has returned, the snapshot is not in the store yet, and a
restore asked for meanwhile waits its turn instead of being refused. Released, the snapshot
answers 201 with a durable commit.

Then the Jupyter server (a real ``jupyter server`` process) is SIGKILLed in the ingest, at the
store's crash points: after its first pack (the commit is absent) and after the thread moved
(the commit is complete). Either way the kernel runs on with its state and the store checks
out; a new server finds the commit (or not) and snapshots on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path

import psutil
import pytest
from reliakit import (
    BIG,
    OperationEvents,
    ServerProcess,
    assert_store_ok,
    fill,
    make_base,
    needs_helper,
    state_intact,
    store_cli,
    store_state,
    until,
)

pytestmark = [needs_helper, pytest.mark.timeout(240)]

HOOKS = """
from infinijup.kernel_magics import register_quiesce_hook, register_resume_hook
calls = []
register_quiesce_hook(lambda: calls.append("quiesce"))
register_resume_hook(lambda restored: calls.append(("resume", restored)))
"""


@pytest.fixture
def ingest_hold(tmp_path, monkeypatch):
    """The store's hold point before the ingest, armed (the server runs in this process)."""
    holds = tmp_path / "store-holds"
    holds.mkdir()
    monkeypatch.setenv("INFINIJUP_STORE_HOLDS", str(holds))
    point = holds / "before_ingest"
    point.touch()
    yield point
    point.unlink(missing_ok=True)


async def _reached(point: Path) -> None:
    reached = point.with_name(point.name + ".reached")
    await until(reached.exists, 120, f"the hold point {point.name}")
    reached.unlink()


async def test_the_kernel_answers_while_its_snapshot_is_stored(notebook, jp_serverapp,
                                                                store_path, ingest_hold):
    nb = notebook
    events = OperationEvents(jp_serverapp)
    try:
        await nb.execute(HOOKS + "x = 'snapshotted'")
        digest = await fill(nb, 64, seed=71)
        ingest_hold.unlink()  # the base snapshot goes straight through
        base = await nb.snapshot(message="base")
        ingest_hold.touch()
        before = store_state(store_path)

        snap = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id,
                                                          "message": "held"}))
        await _reached(ingest_hold)
        # the kernel was resumed right after the dump and runs cells now
        calls = await nb.value("calls")
        while len(calls) < 4:  # the resume request and this cell race to the kernel
            calls = await nb.value("calls")
        assert calls == ["quiesce", ("resume", False)] * 2
        await nb.execute("x = 'moved on'; y = 41 + 1")
        assert await nb.value("(x, y)") == ("moved on", 42)
        status = json.loads((await nb.fetch("infinijup", "status",
                                            params={"kernel_id": nb.kernel_id})).body)
        assert status["operation"]["op"] == "snapshot" and status["operation"]["phase"] == "store"
        assert store_state(store_path) == before and not snap.done()
        # a restore asked for now queues behind the ingest (no 409)
        restore = asyncio.ensure_future(nb.post("restore", {"kernel_id": nb.kernel_id,
                                                            "commit": base["commit"]}))

        ingest_hold.unlink()
        r = await snap
        assert r.code == 201, r.body
        held = json.loads(r.body)
        assert held["parents"] == [base["commit"]]
        assert held["stats"]["running_again_s"] < held["stats"]["duration_s"]
        r = await restore
        assert r.code == 200, r.body
        await state_intact(nb, digest, {"x": "snapshotted"})
        order = [(e["op"], e["phase"]) for e in events.events
                 if e["kernel_id"] == nb.kernel_id and e["phase"] in ("queued", "done")]
        # the restore started once the snapshot was done
        assert order[-3:] == [("snapshot", "done"), ("restore", "queued"), ("restore", "done")]
        assert_store_ok(store_path)
    finally:
        events.close()


async def test_the_magic_returns_once_the_kernel_is_dumped(notebook, store_path, ingest_hold):
    nb = notebook
    await nb.execute("x = 'in the snapshot'")
    out = await nb.execute("%snapshot -m early")
    # the ingest is held, so this answer came before the store had the commit
    # (no id yet: a line under it, "Storing it...", gets it in place: test_magics.py)
    assert re.fullmatch(r"Snapshot taken on thread 'main' \(.+ image, paused [\d.]+ s\)\n",
                        out["stdout"]), out
    assert store_state(store_path)["commits"] == []
    await nb.execute("x = 'next cell'")
    ingest_hold.unlink()
    hist = await nb.history()  # waits for the kernel's snapshot to be stored
    assert [c["message"] for c in hist["commits"]] == ["early"]
    # -w waits for the store, and says which commit
    out = await nb.execute("%snapshot -w -m waited")
    assert re.match(r"Snapshot [0-9a-f]{12} on thread 'main'", out["stdout"]), out
    assert [c["message"] for c in (await nb.history())["commits"]] == ["waited", "early"]
    await nb.restore(hist["commits"][0]["id"])
    assert await nb.value("x") == "in the snapshot"


# --- the server killed in the ingest ---------------------------------------------------------
def _kernel_root(kernel_id: str) -> int:
    for proc in psutil.process_iter(["cmdline"]):
        if any(f"kernel-{kernel_id}.json" in a for a in (proc.info["cmdline"] or [])):
            return proc.ppid()
    raise AssertionError(f"no process for kernel {kernel_id}")


@pytest.fixture
def server_base():
    base = make_base()
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("crash_at, committed", [("after_pack:1", False),
                                                 ("after_ref:1", True)])
def test_server_killed_mid_ingest(helper_up, server_base, store_path, crash_at, committed):
    """The killed snapshot is the server's first commit, so the crash points count from it."""
    from infinijup.helper_client import HelperClient

    helper = HelperClient(helper_up.socket_path, timeout=120)
    notebooks = server_base / "notebooks"
    first = ServerProcess(server_base / "a", helper_up.socket_path, store_path, notebooks,
                          extra_env={"INFINIJUP_STORE_CRASH_AT": crash_at})
    first.start()
    root = None
    try:
        kernel_id = first.open_session("ingest.ipynb")
        kernel = first.kernel_client(kernel_id)
        root = _kernel_root(kernel_id)
        kernel.execute("x = 'kept'")
        kernel.execute(BIG.format(mib=200, seed=72), timeout=120)
        digest = kernel.evaluate(d="big_digest")["d"]

        outcome = {}
        snap = threading.Thread(target=lambda: outcome.update(r=_try_snapshot(first, kernel_id)))
        snap.start()
        assert first.wait_exited() == -signal.SIGKILL  # at its crash point, in the ingest
        snap.join(120)
        assert outcome["r"] == "connection lost"

        # the kernel runs on, its state intact
        kernel.wait_answering()
        assert kernel.evaluate(d="__import__('hashlib').sha256(big).hexdigest()",
                               x="x")["d"] == digest
        assert helper.status(root).alive
        # the commit is complete or absent, and the store checks out either way
        state = store_state(store_path)
        if committed:
            assert len(state["commits"]) == 1 and list(state["threads"].values()) == \
                state["commits"], state
        else:
            assert state == {"threads": {}, "commits": []}, state
        assert_store_ok(store_path)
        gc = store_cli(store_path, "gc")
        assert gc.returncode == 0, gc.stderr

        # a new server on the same store and helper: the history says the same; it goes on
        second = ServerProcess(server_base / "b", helper_up.socket_path, store_path, notebooks)
        second.start()
        try:
            new_id = second.open_session("ingest.ipynb")
            code, hist = second.request("GET", f"/infinijup/history?kernel_id={new_id}")
            assert code == 200 and [c["id"] for c in hist["commits"]] == state["commits"]
            code, snap2 = second.request("POST", "/infinijup/snapshot", {"kernel_id": new_id})
            # a fresh kernel: a new root, next to main if main has a snapshot (engine/heads.py)
            assert code == 201 and snap2["parents"] == [], snap2
            assert snap2["thread"] == ("main-1" if state["commits"] else "main"), snap2
            assert helper_up.user_entries() == {"images": [], "restore": []}
            if committed:  # the commit the dead server made restores
                code, body = second.request("POST", "/infinijup/restore",
                                            {"kernel_id": new_id, "commit": state["commits"][0]})
                assert code == 200, body
            code, _ = second.request("DELETE", f"/api/kernels/{new_id}")
            assert code == 204
        finally:
            second.stop()
        assert_store_ok(store_path)
        kernel.close()
    finally:
        first.stop()
        if root is not None and psutil.pid_exists(root):
            helper.kill(root)  # the orphaned kernel: nobody else will end it
        for leftover in ("images", "restore"):
            path = os.path.join(helper_up.work_dir, "0", leftover)
            if os.path.isdir(path):
                shutil.rmtree(path)


def _try_snapshot(server: ServerProcess, kernel_id: str) -> str:
    try:
        code, body = server.request("POST", "/infinijup/snapshot", {"kernel_id": kernel_id})
    except OSError:
        return "connection lost"
    return f"answered {code}: {body}"
