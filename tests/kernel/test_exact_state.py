"""Exactness: nothing Infinijup does around a snapshot, a restore or a reconnect moves state the
user can observe in the kernel (issue 18). Real server, real kernels, real CRIU.

Each probe cell prints what the user could look at: the global ``random`` state, ``_``/``__``/
``___``, ``Out``, ``sys.last_*``, the execution count and ``In``, ``warnings.filters``,
``sys.modules``, the user namespace's names, IPython's ``last_execution_result``. A probe cell
itself moves the execution count and ``In`` by one and becomes the last result; everything else
must stay exactly as it was. The warnings registry is checked through the filters' version
that each warning records in it.
"""

from __future__ import annotations

import random

from kernelkit import needs_helper

pytestmark = [needs_helper, __import__("pytest").mark.timeout(300)]

SETUP = """
import hashlib, random, re, sys, warnings
random.seed(1); random.random()
def warn_once():
    warnings.warn("shown once per location", UserWarning)
def probe():
    ip = get_ipython()
    last = ip.last_execution_result
    return {
        "random": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
        "_": repr(_), "__": repr(__), "___": repr(___),
        "Out": {k: repr(v) for k, v in Out.items()},
        "last": (repr(getattr(sys, "last_type", None)), repr(getattr(sys, "last_value", None)),
                 id(getattr(sys, "last_traceback", None))),
        "count": ip.execution_count, "n_in": len(In),
        "filters": repr(warnings.filters),
        "modules": sorted(sys.modules),
        "names": sorted(k for k in ip.user_ns if not re.fullmatch(r"_i+\\d*", k)),
        "last_result": (last.info.raw_cell if last is not None else None,
                        ip.last_execution_succeeded),
    }
"""
PROBE = "print(repr(probe()))"
# IPython empties the user's ``__warningregistry__`` before each cell (so a warning shows in
# each cell); what our part could move is the filters' version a warning records there.
WARN = "warn_once(); print(__warningregistry__['version'])"


def expected_draws(n: int) -> list[float]:
    """What the kernel's ``random`` gives after ``random.seed(1); random.random()``."""
    rng = random.Random(1)
    rng.random()
    return [rng.random() for _ in range(n)]


def plus(probe: dict, cells: int) -> dict:
    """``probe`` as it reads ``cells`` probe cells later, had nothing else happened."""
    return {**probe, "count": probe["count"] + cells, "n_in": probe["n_in"] + cells,
            "last_result": (PROBE, True)}


async def prepare(nb) -> dict:
    """A kernel with something in each piece of observable state; returns a probe of it."""
    await nb.execute(SETUP)
    await nb.execute("41 + 1")  # _ and Out
    await nb.execute("'second'")  # __
    failed = await nb.collect(nb.send_execute("1 / 0"))  # sys.last_*
    assert failed["reply"]["status"] == "error"
    shown = await nb.execute("warn_once()")
    assert "shown once per location" in shown["stderr"]
    v1 = int((await nb.execute(WARN))["stdout"])
    nb.warn_version = int((await nb.execute(WARN))["stdout"])
    nb.warn_version_per_cell = nb.warn_version - v1
    await nb.value("probe()")
    return await nb.value("probe()")


async def test_snapshot_restore_reconnect_leave_user_state_alone(notebook):
    nb = notebook
    draws = expected_draws(3)
    p1 = await prepare(nb)
    assert p1["_"] == "'second'" and p1["__"] == "42" and "ZeroDivisionError" in p1["last"][1]

    per_cell, version = nb.warn_version_per_cell, nb.warn_version
    snap = await nb.snapshot(message="S")
    p2 = await nb.value("probe()")
    assert p2 == plus(p1, 1)  # the snapshot moved nothing (count, In, modules, _ ...)
    warned = int((await nb.execute(WARN))["stdout"])
    assert warned == version + 3 * per_cell  # 3 cells: two probes and this one
    assert await nb.value("random.random()") == draws[0]

    await nb.restore(snap["commit"])
    p3 = await nb.value("probe()")
    assert p3 == p2  # the restored kernel reads exactly as the original did after S
    assert int((await nb.execute(WARN))["stdout"]) == warned
    assert await nb.value("random.random()") == draws[0]
    again = await nb.execute("41 + 1")
    # (inside a cell, execution_count is already the next cell's number)
    assert again["reply"]["execution_count"] == p3["count"] + 2

    p4 = await nb.value("probe()")
    await nb.reconnect()  # a new websocket and a kernel_info request, as a reloaded tab does
    p5 = await nb.value("probe()")
    assert p5 == plus(p4, 1)
    assert await nb.value("random.random()") == draws[1]


async def test_restore_twice_gives_the_same_draws(notebook):
    nb = notebook
    draws = expected_draws(2)
    await nb.execute("import random; random.seed(1); random.random()")
    snap = await nb.snapshot()
    for _ in range(2):
        await nb.restore(snap["commit"])
        assert await nb.value("(random.random(), random.random())") == tuple(draws)


async def test_the_magic_snapshot_leaves_user_state_alone(notebook):
    nb = notebook
    p1 = await prepare(nb)
    out = await nb.execute("%snapshot -m magic")
    assert out["stdout"].startswith("Snapshot ") and out["result"] is None
    p2 = await nb.value("probe()")
    # The %snapshot cell is the user's own: it counts, and is the last result before the probe.
    assert p2 == {**plus(p1, 2), "last_result": ("%snapshot -m magic", True)}
    commit = (await nb.history())["commits"][0]["id"]
    await nb.restore(commit)
    assert await nb.value("probe()") == p2


async def test_kernel_machinery_draws_nothing_from_random(notebook):
    """Each place the kernel drew from the global ``random``, called directly."""
    nb = notebook
    out = await nb.value(
        "(lambda ip, random, state: ("
        "ip.banner, ip.kernel.session.digest_history.update(str(i).encode() for i in range(100)),"
        "ip.kernel.session._cull_digest_history(), random.getstate() == state)[-1])"
        "(get_ipython(), __import__('random'), __import__('random').getstate())")
    assert out is True
