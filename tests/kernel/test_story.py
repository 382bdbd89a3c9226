"""The user's story of issue 4, against a real Jupyter server, real kernels and real CRIU:
snapshot, change, restore (same notebook, same websocket), branch, history, and the state that
pickling cannot carry."""

from __future__ import annotations

import asyncio
import json
import time

from kernelkit import needs_helper

pytestmark = [needs_helper, __import__("pytest").mark.timeout(240)]

EVENTS = "https://events.infinijup.dev/operation"


async def until(predicate, what: str, timeout: float = 120.0) -> None:
    """Wait for an event the test caused (the deadline only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def wait_for(nb, expr: str, timeout: float = 120.0) -> None:
    """Wait until ``expr`` is true in the kernel."""
    deadline = time.monotonic() + timeout
    while not await nb.value(expr):
        assert time.monotonic() < deadline, f"timed out waiting for {expr}"
        await asyncio.sleep(0.01)

SETUP = """
x = 1
import numpy as np
rng = np.random.default_rng(0)
a = rng.random(10**7)
"""

# What pickling-based tools cannot carry: a file mid-read, a generator halfway, a running
# thread, a closure, an in-memory sqlite database, a C extension object mid-computation.
UNPICKLABLE = """
import hashlib, os, sqlite3, tempfile, threading, time
_p = os.path.join(tempfile.mkdtemp(), "lines.txt")
with open(_p, "w") as f:
    f.write("".join(f"line {i}\\n" for i in range(100)))
fh = open(_p)
first = [fh.readline() for _ in range(10)]
def counter():
    n = 0
    while True:
        yield n
        n += 1
gen = counter(); [next(gen) for _ in range(5)]
def make_adder(k):
    return lambda v: v + k
add7 = make_adder(7)
db = sqlite3.connect(":memory:")
db.execute("create table t (k integer primary key, v text)")
db.executemany("insert into t (v) values (?)", [(f"v{i}",) for i in range(50)])
db.commit()
h = hashlib.sha256(b"part one;")
ticks = [0]
def ticker():
    while True:
        ticks[0] += 1
        time.sleep(0.01)
bg = threading.Thread(target=ticker, daemon=True); bg.start()
"""

CHECK_UNPICKLABLE = """
print(repr((fh.readline(), next(gen), add7(35), db.execute("select count(*), max(v) from t").fetchone(),
            h.copy().hexdigest(), bg.is_alive())))
"""


async def test_snapshot_restore_branch_story(notebook, jp_fetch):
    nb = notebook
    await nb.execute(SETUP)
    await nb.execute(UNPICKLABLE)
    digest = await nb.value("hashlib.sha256(a.tobytes()).hexdigest()")
    count_at_a = (await nb.execute("pass"))["reply"]["execution_count"]

    # 2. Snapshot A; draw once right after it; x = 2; snapshot B.
    snap_a = await nb.snapshot(message="A")
    a_id = snap_a["commit"]
    assert snap_a["thread"] == "main" and snap_a["parents"] == []
    assert snap_a["stats"]["image_bytes"] > 80 * 2**20  # the 76 MiB array is in there
    draw_after_a = await nb.value("rng.random()")
    await nb.execute("a[:1000] = -1.0")  # a change the restore must undo
    assert await nb.value("hashlib.sha256(a.tobytes()).hexdigest()") != digest
    expected_unpicklable = await nb.value(CHECK_UNPICKLABLE.strip().removeprefix("print(repr(").removesuffix("))"))
    await nb.execute("x = 2")
    snap_b = await nb.snapshot(message="B")
    assert snap_b["thread"] == "main" and snap_b["parents"] == [a_id]
    # Dedup: B adds far less than A's image.
    assert snap_b["stats"]["stored_bytes"] < snap_a["stats"]["image_bytes"] * 0.2, snap_b

    # 3. Restore A on the same websocket, no reconnect by hand.
    restored = await nb.restore(a_id[:10])
    assert restored["commit"] == a_id and restored["kernel_id"] == nb.kernel_id
    out = await nb.execute("print(repr((x, rng.random())))")
    assert eval(out["stdout"]) == (1, draw_after_a)
    assert out["reply"]["execution_count"] == count_at_a + 1
    assert await nb.value("hashlib.sha256(a.tobytes()).hexdigest()") == digest
    # 5. The unpicklable state came back too (and the thread is running again).
    assert await nb.value(CHECK_UNPICKLABLE.strip().removeprefix("print(repr(").removesuffix("))")) == expected_unpicklable
    t0 = await nb.value("ticks[0]")
    await wait_for(nb, f"ticks[0] > {t0}")

    # 4. From A: x = 3, snapshot C lands on a new thread; B is not lost.
    await nb.execute("x = 3")
    snap_c = await nb.snapshot(message="C")
    assert snap_c["thread"] not in ("main", "") and snap_c["parents"] == [a_id]
    hist = await nb.history()
    ids = {c["id"]: c for c in hist["commits"]}
    assert set(ids) == {a_id, snap_b["commit"], snap_c["commit"]}
    assert hist["threads"]["main"] == snap_b["commit"]
    assert hist["threads"][snap_c["thread"]] == snap_c["commit"]
    assert ids[snap_b["commit"]]["parents"] == [a_id] == ids[snap_c["commit"]]["parents"]
    assert hist["head"] == {"thread": snap_c["thread"], "commit": snap_c["commit"],
                            "next_thread": snap_c["thread"]}
    assert "connection" not in ids[a_id]["metadata"]  # the kernel's key never leaves the server

    # Restoring B by thread name gives x == 2; the next snapshot goes on main again.
    await nb.restore("main")
    assert await nb.value("x") == 2
    snap_d = await nb.snapshot(message="D")
    assert snap_d["thread"] == "main" and snap_d["parents"] == [snap_b["commit"]]


async def test_snapshot_waits_for_a_running_cell(notebook, jp_serverapp, tmp_path):
    """A snapshot waits for the running cell (up to the busy timeout), then goes on, or
    answers 409 leaving the cell alone. The cells wait for files the test writes."""
    nb = notebook
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    await nb.execute("import os, pathlib, time\n"
                     "def gate(name):\n"
                     f"    pathlib.Path({str(tmp_path)!r}, name + '.running').touch()\n"
                     f"    while not os.path.exists(os.path.join({str(tmp_path)!r}, name)):\n"
                     "        time.sleep(0.005)")
    # A cell that outlives the busy timeout: 409, and the cell is not cut.
    manager.busy_timeout = 2.0
    long_cell = nb.send_execute("gate('long'); print('finished')")
    await until(lambda: (tmp_path / "long.running").exists(), "the long cell to run")
    r = await nb.post("snapshot", {"kernel_id": nb.kernel_id})
    assert r.code == 409, r.body
    assert json.loads(r.body)["reason"] == "kernel_busy"
    (tmp_path / "long").touch()
    out = await nb.collect(long_cell, timeout=120)
    assert out["stdout"] == "finished\n" and out["reply"]["status"] == "ok"
    # A cell within the busy timeout: the snapshot waits for it, then succeeds, with its
    # result in the snapshot.
    manager.busy_timeout = 120.0
    short_cell = nb.send_execute("gate('short'); y = 42")
    await until(lambda: (tmp_path / "short.running").exists(), "the short cell to run")
    events = []

    async def listener(logger, schema_id, data):
        events.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENTS, listener=listener)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    await until(lambda: any(e["phase"] == "quiesce" for e in events), "the snapshot to begin")
    assert not task.done()  # waiting for the cell
    (tmp_path / "short").touch()
    r = await task
    assert r.code == 201, r.body
    await nb.collect(short_cell, timeout=120)
    await nb.execute("y = 0")
    await nb.restore(json.loads(r.body)["commit"])
    assert await nb.value("y") == 42


async def test_magics(notebook):
    nb = notebook
    await nb.execute("z = 'first'")
    out = await nb.execute("%snapshot -m 'from the magic'")
    assert out["stdout"].startswith("Snapshot "), out
    hist = await nb.history()
    assert [c["message"] for c in hist["commits"]] == ["from the magic"]
    first = hist["commits"][0]["id"]
    await nb.execute("z = 'second'")
    out = await nb.execute(f"%restore {first[:12]}")
    assert "Restoring" in out["stdout"]
    async def last_operation() -> dict:
        r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
        return json.loads(r.body)["last_operation"] or {}

    deadline = time.monotonic() + 120  # the restore starts once the %restore cell is done
    while (last := await last_operation()).get("op") != "restore":
        assert time.monotonic() < deadline, last
        await asyncio.sleep(0.05)
    assert last == {**last, "phase": "done", "commit": first}, last
    assert await nb.value("z") == "first"
    out = await nb.execute("%snapshots")
    assert first[:12] in out["stdout"] and "HEAD" in out["stdout"]
    out = await nb.execute("%branch side")
    assert "side" in out["stdout"]
    out = await nb.execute("%snapshot")
    assert "on thread 'side'" in out["stdout"], out


async def test_errors(notebook, jp_fetch):
    nb = notebook
    r = await nb.post("snapshot", {"kernel_id": "no-such-kernel"})
    assert r.code == 404 and json.loads(r.body)["reason"] == "unknown_kernel"
    r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": "deadbeefdeadbeef"})
    assert r.code == 404, r.body
    assert set(json.loads(r.body)) == {"message", "reason"}
    r = await nb.post("restore", {"kernel_id": nb.kernel_id})
    assert r.code == 400
    r = await jp_fetch("infinijup", "snapshot", method="POST", body="not json", raise_error=False)
    assert r.code == 400
    r = await nb.post("snapshot", {"kernel_id": nb.kernel_id, "thread": "../bad"})
    assert r.code == 400
    # The kernel is untouched by all of that.
    await nb.execute("w = 5")
    assert await nb.value("w") == 5


async def test_progress_events_are_published(notebook, jp_serverapp):
    nb = notebook
    seen: list[dict] = []

    async def listener(logger, schema_id, data):
        seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENTS, listener=listener)
    snap = await nb.snapshot(message="with events")
    await nb.restore(snap["commit"])
    # listeners run as tasks: let them drain
    await until(lambda: any(e["op"] == "restore" and e["phase"] == "done" for e in seen),
                "the restore's last event")
    snap_phases = [e["phase"] for e in seen if e["op"] == "snapshot"]
    assert snap_phases[0] == "queued" and snap_phases[-1] == "done", snap_phases
    assert {"quiesce", "dump", "store"} <= set(snap_phases), snap_phases
    restore_phases = [e["phase"] for e in seen if e["op"] == "restore"]
    assert {"kill", "restore", "reconnect", "done"} <= set(restore_phases), restore_phases
    done = [e for e in seen if e["phase"] == "done"]
    assert done[0]["commit"] == snap["commit"] and done[0]["kernel_id"] == nb.kernel_id
    assert all(e["path"] == "story.ipynb" for e in seen)


async def test_plain_kernels_are_refused_with_422(jp_fetch, jp_serverapp):
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel_id = json.loads(r.body)["id"]
    try:
        r = await jp_fetch("infinijup", "snapshot", method="POST",
                           body=json.dumps({"kernel_id": kernel_id}), raise_error=False)
        assert r.code == 422, r.body
        assert json.loads(r.body)["reason"] == "kernel_not_managed"
        r = await jp_fetch("infinijup", "status", params={"kernel_id": kernel_id})
        assert json.loads(r.body)["managed"] is False
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE", raise_error=False)


async def test_history_and_restore_survive_a_kernel_restart(notebook):
    nb = notebook
    await nb.execute("kept = 'before restart'")
    a = await nb.snapshot(message="before restart")
    await nb.restart()
    assert await nb.value("'kept' in globals()") is False
    hist = await nb.history()
    assert [c["id"] for c in hist["commits"]] == [a["commit"]]
    # a fresh state: its next snapshot is a new root, next to main (issue 28, item 4)
    assert hist["head"] == {"thread": "main", "commit": None, "next_thread": "main-1"}
    b = await nb.snapshot(message="after restart")
    assert b["thread"] == "main-1" and b["parents"] == []
    hist = await nb.history()
    assert hist["threads"] == {"main": a["commit"], "main-1": b["commit"]}
    await nb.restore(a["commit"])
    assert await nb.value("kept") == "before restart"
