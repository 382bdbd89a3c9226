"""The window of automatic snapshots (issue 30) through a real server, helper and CRIU: after
every retention pass the automatic snapshots not thinned are within the window's count and
bytes, and thinning comes in batches (one gc per batch, not per cell).

Each cell here is snapshotted (``%autosnapshot on after=0.0001``: every cell that changes a
variable). A cell's answer does not wait for the store, so each check waits for the events
that matter: the kernel's HEAD is its new automatic snapshot (set, on the server's loop, in the
same step that asks for a pass), then no pass is running.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(600)]


@pytest.fixture
def jp_server_config(jp_server_config):
    manager = {**jp_server_config["SnapshotManager"], "autosnapshot": True,
               "autosnapshot_after_s": 1.0, "autosnapshot_share": 1e-6, "hot_tier_bytes": 0}
    return {**jp_server_config, "SnapshotManager": manager}


async def settled(m, kernel_id: str, autos_before: int) -> None:  # noqa: ANN001
    """Until the cell's automatic snapshot is the kernel's HEAD and its pass is done."""
    deadline = time.monotonic() + 120
    while True:
        repo = m.repo()
        autos = repo.index.find_commits({"auto": True})
        head = m.heads.get(kernel_id).commit
        if len(autos) > autos_before and head == autos[0] and not m.retention._running:
            return
        assert time.monotonic() < deadline, "no automatic snapshot (or its pass) after the cell"
        await asyncio.sleep(0.05)


async def cells(nb, m, codes: list[str]) -> list[dict]:  # noqa: ANN001
    """Run each cell; after each, the window's state (not thinned: count, bytes)."""
    from infinijup.serverext.retention import Automatic

    seen = []
    for code in codes:
        before = len(m.repo().index.find_commits({"auto": True}))
        await nb.execute(code)
        await settled(m, nb.kernel_id, before)
        live = Automatic()(m.repo())
        seen.append({"count": len(live), "bytes": sum(a.stored_bytes for a in live),
                     "thinned": list(m.retention.last.get("thinned") or [])})
    return seen


async def test_the_count_window_thins_in_a_batch_below_its_limit(notebook, jp_serverapp):
    m = jp_serverapp.web_app.settings["infinijup_manager"]
    m.autosnapshot_keep = 20  # batches of 2: over 20, thinned to 18
    nb = notebook
    await nb.execute("%autosnapshot on after=0.0001")
    await nb.snapshot(message="base")  # the whole image: a snapshot of the user's, not counted
    seen = await cells(nb, m, [f"x = {i}" for i in range(1, 25)])
    counts = [s["count"] for s in seen]
    assert max(counts) <= 20, counts
    assert counts[:20] == list(range(1, 21)), counts  # nothing thinned up to the limit
    assert counts[20] == 18 and len(seen[20]["thinned"]) == 3, seen[20]  # one pass, three
    assert counts[21:] == [19, 20, 18], counts
    from infinijup.engine.retention import over_limits
    from infinijup.serverext.retention import Automatic
    assert not over_limits(Automatic()(m.repo()), m.retention.window())


async def test_the_bytes_window_stays_within_its_budget(notebook, jp_serverapp):
    m = jp_serverapp.web_app.settings["infinijup_manager"]
    budget = 16 * 2**20  # five or so of these snapshots
    m.autosnapshot_keep_bytes = budget
    nb = notebook
    await nb.execute("import numpy as np\n%autosnapshot on after=0.0001")
    await nb.snapshot(message="base")
    # each cell: a new MiB of random numbers (3-4 MiB stored per snapshot here: the array,
    # numpy's temporaries, the heap around them)
    seen = await cells(nb, m, [f"a = np.random.default_rng({i}).random(131072)"
                               for i in range(12)])
    assert all(s["bytes"] <= budget for s in seen), seen
    assert any(s["thinned"] for s in seen), seen  # the budget did bind
    assert min(s["count"] for s in seen[6:]) >= 2, seen  # thinned to below it, not emptied
    assert await nb.value("float(a[0])") == float(
        __import__("numpy").random.default_rng(11).random(131072)[0])


def test_the_automatic_snapshots_found_pass_after_pass(tmp_path):
    """What a pass reads (serverext/retention.Automatic) on a real store: only automatic
    commits, each read once, and a thinning by anyone (another server on the store) seen."""
    from infinijup.serverext.retention import Automatic
    from infinijup.store import Repository
    from infinijup.store.thinned import mark_thinned

    repo = Repository.init(tmp_path / "store")
    ids = [repo.commit_tree({}, thread="main", metadata={"auto": True} if i % 3 else {}).id
           for i in range(7)]
    autos = [c for i, c in enumerate(ids) if i % 3]
    found = Automatic()
    assert sorted(a.id for a in found(repo)) == sorted(autos)
    reads = []
    get_commit = repo.get_commit
    repo.get_commit = lambda ref: reads.append(ref) or get_commit(ref)
    new = repo.commit_tree({}, thread="main", metadata={"auto": True}).id
    assert sorted(a.id for a in found(repo)) == sorted([*autos, new])
    assert reads == [new]  # the others were read once, before
    other = Repository.open(tmp_path / "store")
    mark_thinned(other, autos[:2])
    assert sorted(a.id for a in found(repo)) == sorted([*autos[2:], new])
    assert set(found.known) == {*autos[2:], new}
