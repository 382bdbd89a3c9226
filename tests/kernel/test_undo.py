"""Automatic snapshots and Undo (issue 30) against a real Jupyter server, helper and CRIU.

The server's rule is set so that time alone decides (no test depends on how fast this machine
is): a cell of at least 1 s is always snapshotted (``autosnapshot_after_s``), and the share is
so small that no quicker cell ever is. A slow cell is ``time.sleep(1.1)`` plus its work.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(300)]

SLOW = "time.sleep(1.1)\n"


@pytest.fixture
def jp_server_config(jp_server_config):
    manager = {**jp_server_config["SnapshotManager"], "autosnapshot": True,
               "autosnapshot_after_s": 1.0, "autosnapshot_share": 1e-6}
    return {**jp_server_config, "SnapshotManager": manager}


async def history(nb) -> list[dict]:
    r = await nb.fetch("infinijup", "history", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)["commits"]


def cell_of(commit: dict) -> int | None:
    return ((commit.get("metadata") or {}).get("cell") or {}).get("execution_count")


async def run(nb, code: str) -> int:
    """Run a cell; its execution count."""
    return (await nb.execute(code))["reply"]["execution_count"]


async def state_left(nb, moved: dict) -> str:
    """The commit of the state an undo left: in its answer, or, where the kernel was set aside
    and stored behind the undo (undo.py), once that commit is in the history."""
    if moved["from"] is not None:
        return moved["from"]
    assert moved["saving"] is True, moved
    for _ in range(2400):  # hang guard only: waits for the commit, not for a time
        found = [c["id"] for c in await history(nb) if c.get("message") == "before undo"]
        if found:
            return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError("the state the undo left was never stored")


async def test_the_rule_decides_which_cells_are_snapshotted(notebook):
    nb = notebook
    await nb.execute("import time")
    slow = await run(nb, SLOW + "x = 1")  # slow, changes x: snapshotted
    prints = await run(nb, SLOW + "print('only prints')")  # slow, changes nothing: not
    await nb.execute("%autosnapshot status")  # (the kernel's own magics count as no cell)
    out = await nb.execute("%autosnapshot status")
    assert "Last cell: the cell changed no variable" in out["stdout"], out["stdout"]
    quick = await run(nb, "x = 2")  # quick: not
    commits = await history(nb)
    auto = {cell_of(c) for c in commits if (c.get("metadata") or {}).get("auto")}
    assert slow in auto
    assert quick not in auto and prints not in auto
    assert "Automatic snapshots are on" in out["stdout"]
    r = await nb.post("autosnapshot", {"kernel_id": nb.kernel_id, "on": False})  # Lab's switch
    assert r.code == 200 and json.loads(r.body)["on"] is False, r.body
    await nb.execute(SLOW + "x = 5")
    assert len(await history(nb)) == len(commits)  # off: nothing more


async def test_undo_three_times_and_redo(notebook, tmp_path):
    """Each undo: the values, the RNG's next draw and an open file's position of that state."""
    nb = notebook
    data = tmp_path / "data.txt"
    data.write_text("abcdefghij")
    await nb.execute("import time, random")
    await nb.execute(SLOW + f"x = 1\nf = open({str(data)!r})\nf.read(3)\nrandom.seed(5)")
    c2 = await run(nb, SLOW + "x = 2\nf.read(2)\nr2 = random.random()")
    c3 = await run(nb, SLOW + "x = 3\nf.read(1)")
    c4 = await run(nb, "x = 4\nf.read(1)")  # quick: no snapshot of it

    async def state() -> tuple:
        return (await nb.value("x"), await nb.value("f.tell()"))

    async def post(what: str) -> dict:
        r = await nb.post(what, {"kernel_id": nb.kernel_id})
        assert r.code == 200, r.body
        return json.loads(r.body)

    first = await post("undo")  # the kernel changed since its last snapshot: saved, then back
    assert first["saved"] is True
    assert first["says"] == f"Back to after [{c3}] time.sleep(1.1)", first
    assert await state() == (3, 6)
    second = await post("undo")
    assert await state() == (2, 5)
    assert second["says"] == f"Back to after [{c2}] time.sleep(1.1)", second
    await post("undo")
    assert await state() == (1, 3)
    # the RNG goes on from where it was then: seeded, nothing drawn yet
    assert await nb.value("random.random()") == random.Random(5).random()
    await post("redo")
    assert await state() == (2, 5)
    assert await nb.value("r2") == random.Random(5).random()
    # automatic snapshots stayed on through the restores (the snapshots had them on too, but
    # a kernel turned off meanwhile stays off: below)
    await nb.execute("%autosnapshot off")
    await post("undo")
    out = await nb.execute("%autosnapshot status")
    assert "Automatic snapshots are off" in out["stdout"], out["stdout"]
    # nothing was lost: the state undone first is still in the history
    left = await state_left(nb, first)
    commits = await history(nb)
    assert [cell_of(c) for c in commits if c["id"] == left] == [c4]


async def test_undo_refuses_with_nothing_to_undo(notebook):
    nb = notebook
    await nb.execute("%autosnapshot off")
    r = await nb.post("undo", {"kernel_id": nb.kernel_id})
    assert r.code == 409, r.body
    assert json.loads(r.body)["reason"] == "nothing_to_undo"
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})
    assert r.code == 409 and json.loads(r.body)["reason"] == "nothing_to_redo"
    msg = nb.send_execute("%undo")
    out = await nb.collect(msg)
    assert out["error"] and "nothing to undo" in out["error"], out


async def test_old_automatic_snapshots_are_thinned_and_undo_stops_there(notebook, jp_serverapp):
    """Four automatic snapshots, a window of two: the two oldest keep their place in the
    history (thinned, not resumable), their restore is refused with the reason, undo goes
    back to the newest kept one and no further."""
    import asyncio
    import time

    from infinijup.store.thinned import thinned

    m = jp_serverapp.web_app.settings["infinijup_manager"]
    m.autosnapshot_keep = 2
    nb = notebook
    await nb.execute("import time")
    for i in range(1, 5):
        await nb.execute(SLOW + f"x = {i}")
    deadline = time.monotonic() + 120
    while len(thinned(m.repo())) < 2 or m.retention._running:  # the pass after the 4th
        assert time.monotonic() < deadline, "no thinning"
        await asyncio.sleep(0.05)
    commits = await history(nb)
    autos = [c for c in commits if (c.get("metadata") or {}).get("auto")]
    assert [c.get("thinned", False) for c in autos] == [False, False, True, True]  # newest first
    assert autos[3]["resumable"] is False and "thinned" in autos[3]["resumable_reason"]
    r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": autos[3]["id"]})
    assert r.code == 409 and json.loads(r.body)["reason"] == "commit_thinned", r.body
    assert await nb.value("x") == 4  # untouched
    r = await nb.post("undo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert await nb.value("x") == 3
    r = await nb.post("undo", {"kernel_id": nb.kernel_id})
    assert r.code == 409 and json.loads(r.body)["reason"] == "nothing_to_undo", r.body


async def test_automatic_snapshots_and_undo_steps_are_quiet_events(notebook, operation_events):
    """Lab notifies of every operation on an open notebook's kernel, except those its events
    mark quiet: automatic snapshots and the snapshot and restore inside an undo (the undo says
    where it went). A snapshot the user asks for is not quiet."""
    nb, seen = notebook, operation_events
    await nb.execute("import time")
    manual = await nb.snapshot(message="by hand")
    await run(nb, SLOW + "x = 1")  # slow: an automatic snapshot
    await run(nb, "x = 2")  # quick: changed since, the undo saves it first
    r = await nb.post("undo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    moved = json.loads(r.body)
    await state_left(nb, moved)  # (stored behind the undo, where the kernel was set aside)
    for _ in range(200):  # listeners run as tasks: let them drain
        if any(e["op"] == "restore" and e["phase"] == "done" for e in seen) and len(
                [e for e in seen if e["op"] == "snapshot" and e["phase"] == "done"]) >= 3:
            break
        await asyncio.sleep(0.05)
    done = [e for e in seen if e["phase"] == "done"]
    by_commit = {e["commit"]: e for e in done}
    assert by_commit[manual["commit"]].get("quiet") is None, by_commit[manual["commit"]]
    autos = [e for e in done if e["op"] == "snapshot" and e["commit"] != manual["commit"]]
    assert len(autos) == 2 and all(e.get("quiet") is True for e in autos), autos  # cell, undo
    restores = [e for e in done if e["op"] == "restore"]
    assert [e["commit"] for e in restores] == [moved["commit"]]
    assert restores[0].get("quiet") is True


async def test_redo_skips_a_state_deleted_since(notebook):
    """The state an undo left is deleted from the panel: redo says there is nothing to redo
    (after saving the kernel as it is), and the kernel stays where it was."""
    nb = notebook
    await nb.execute("import time")
    await nb.execute(SLOW + "x = 1")
    await nb.execute(SLOW + "x = 2")
    r = await nb.post("undo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    left = await state_left(nb, json.loads(r.body))
    assert await nb.value("x") == 1
    r = await nb.post("delete", {"kernel_id": nb.kernel_id, "commit": left})
    assert r.code == 200, r.body
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})
    assert r.code == 409 and json.loads(r.body)["reason"] == "nothing_to_redo", r.body
    assert await nb.value("x") == 1
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})  # the list is empty now
    assert r.code == 409 and json.loads(r.body)["reason"] == "nothing_to_redo", r.body


async def test_undo_and_redo_of_a_hibernated_kernel_restore_it_awake(notebook):
    """A hibernated kernel is its last snapshot (here its hibernation's own: x changed after
    the one before, too quickly to snapshot): undo goes to the snapshot before, by a restore
    that wakes it there, and redo comes back."""
    nb = notebook
    await nb.execute("import random\nx = 1\nrandom.seed(5)")
    await nb.snapshot(message="x is 1")
    await nb.execute("x = 2\nr = random.random()")  # quick: its state goes with the hibernation
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 200 and json.loads(r.body)["state"] == "hibernated", r.body
    r = await nb.post("undo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert json.loads(r.body)["saved"] is False  # nothing to save: it was hibernated
    assert await nb.value("x") == 1
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert await nb.value("x") == 2
    draws = random.Random(5)
    assert await nb.value("r") == draws.random()
    assert await nb.value("random.random()") == draws.random()
