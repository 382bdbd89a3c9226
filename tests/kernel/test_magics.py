"""Infinijup's magics (issue 18): named apart from IPython's, failing cells when they fail, a
text graph with fork lines, and commits that describe themselves (the cell, the variables)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kernelkit import needs_helper

from infinijup.errors import SnapshotFailed
from infinijup.kernel_magics.graph import render_history
from infinijup.kernel_magics.magics import InfinijupMagics

IPYTHON_MAGICS = """
import json
from ipykernel.zmqshell import ZMQInteractiveShell
ip = ZMQInteractiveShell.instance()
for ext in ("storemagic", "autoreload"):  # the extensions IPython ships
    ip.extension_manager.load_extension("IPython.extensions." + ext)
print(json.dumps({kind: sorted(names) for kind, names in ip.magics_manager.lsmagic().items()}))
"""


def test_magic_names_are_apart_from_ipythons():
    out = subprocess.run([sys.executable, "-c", IPYTHON_MAGICS], capture_output=True, text=True,
                         check=True, timeout=120)
    builtin = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"history", "hist", "store", "reset"} <= set(builtin["line"])  # the listing works
    ours = InfinijupMagics.magics
    assert set(ours["line"]) == {"snapshot", "restore", "snapshots", "branch", "hibernate", "sidecar",
                                  "autosnapshot", "undo", "redo"}
    assert not set(ours["line"]) & set(builtin["line"])
    assert not set(ours["cell"]) & set(builtin["cell"])


def _commit(cid: str, parents: list[str], created: float, message: str = "") -> dict:
    return {"id": cid * 12, "parents": [p * 12 for p in parents], "created": created,
            "message": message, "metadata": {}, "stats": {"stored_bytes": 1024}}


def test_graph_draws_the_fork_point():
    # a <- b (main) and a <- c (side): c and b are drawn in two lanes that meet at a.
    commits = [_commit("c", ["a"], 3, "C"), _commit("b", ["a"], 2, "B"), _commit("a", [], 1, "A")]
    text = render_history(commits, {"main": "b" * 12, "side": "c" * 12}, {"commit": "c" * 12})
    rows = [line.split("  ")[0] for line in text.splitlines()]
    assert rows == ["*", "| *", "|/", "*"], text
    assert "(HEAD, side)" in text.splitlines()[0] and "(main)" in text.splitlines()[1]
    # Two forks of a, the newest lane joining across a lane still open.
    commits = [_commit("e", ["a"], 5), _commit("d", ["b"], 4), _commit("c", ["a"], 3),
               _commit("b", ["a"], 2), _commit("a", [], 1)]
    rows = [line.split("  ")[0] for line in render_history(commits, {}).splitlines()]
    assert rows == ["*", "| *", "| | *", "|_|/", "| *", "|/", "*"], rows
    # A straight line has no connector rows; a commit without a message shows its cell.
    commits = [_commit("b", ["a"], 2), _commit("a", [], 1)]
    commits[0]["metadata"]["cell"] = {"execution_count": 7, "source": "model.fit(x)"}
    lines = render_history(commits, {}).splitlines()
    assert [line.split("  ")[0] for line in lines] == ["*", "*"]
    assert lines[0].endswith("  [7] model.fit(x)")


DESCRIBE = r"""
import json, types, numpy as np
from IPython.core.interactiveshell import InteractiveShell
from infinijup.kernel_magics import describe
ip = InteractiveShell.instance()
ip.run_cell("import numpy as np\nimport os", store_history=True)
ns = ip.user_ns
class Guarded:
    def __sizeof__(self): raise RuntimeError("user code ran")
    def __getattr__(self, name): raise RuntimeError("user code ran")
ns.update(small=np.arange(1000), big=np.zeros(2**21), fortran=np.asfortranarray(np.ones((50, 40))),
          strided=np.ones((400, 400))[::2, ::3], objs=np.array(["a", 1], dtype=object),
          lst=[1, "a", 2.5], tup=(1, 2), dct={"k": [1]}, text="t" * 10, num=10**30,
          guarded=Guarded(), _hidden=1, grid=[[1, 2], [3, 4]], same={"k": [1]},
          box=types.SimpleNamespace(items=[1], arr=np.arange(4)), huge=list(range(5000)),
          cyc=[], api_token="s3cr3t", counter=111)
ns["cyc"].append(ns["cyc"])  # a cycle is walked once
def run():
    d = describe.describe(ip)
    return d["cell"], {it["name"]: it for it in d["variables"]["items"]}, d["variables"]["truncated"]
out = {"first": run()}
ns["small"][5] = -1; ns["big"][:] = 2.0; ns["fortran"][3, 3] = 0.0; ns["strided"][0, 0] = 5.0
ns["lst"] = [1, "a", 2.5]; ns["tup"] = (1, 2); ns["num"] = 10**30
# changed in place, deep inside (issue 28): an append in a dict, a nested item, an object's
# attribute and an array inside an object; rebound to an equal value: unchanged
ns["dct"]["k"].append(2); ns["grid"][1][0] = 7; ns["box"].items.append(2)
ns["box"].arr[1:3] = 0; ns["same"] = {"k": [1]}; ns["huge"][4999] = -1
out["second"] = run()
describe.forget()  # that snapshot was not committed: compare with the first again
ns["text"] = "u" * 10
out["after_forget"] = run()
for i in range(600):
    ns[f"v{i:03}"] = i
describe.describe(ip)
ns["v599"] = -1; ns["zzz"] = 1
out["many"] = run()
print(json.dumps(out))
"""


def test_variable_descriptions_and_fingerprints():
    """describe.py in a plain IPython shell: what is listed, how, and what counts as changed."""
    res = subprocess.run([sys.executable, "-c", DESCRIBE], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    cell, first, truncated = out["first"]
    assert cell == {"execution_count": 1, "source": "import numpy as np"} and not truncated
    assert set(first) == {"small", "big", "fortran", "strided", "objs", "lst", "tup", "dct", "text",
                          "num", "guarded", "grid", "same", "box", "huge", "cyc", "api_token",
                          "counter"}  # no modules,
    # no _names, no In/Out; a variable too large to walk whole says so
    assert first["huge"]["partial"] is True and "partial" not in first["grid"]
    assert all(it["changed"] for it in first.values())
    assert first["small"] | {"fp": ""} == {"name": "small", "type": "ndarray", "size": 8000,
                                             "shape": "(1000,)", "fp": "", "changed": True,
                                             "value": "min 0, max 999, mean 499.5"}
    # what Compare shows (issue 28): small builtin values, cut; never a user __repr__, a
    # container too large, an object array, or a variable whose name says it is a secret
    assert first["counter"]["value"] == "111" and first["lst"]["value"] == "[1, 'a', 2.5]"
    assert first["dct"]["value"] == "{'k': [1]}" and first["text"]["value"] == repr("t" * 10)
    assert first["num"]["value"] == repr(10**30)
    assert not {"guarded", "huge", "objs", "api_token", "cyc", "box"} & \
        {n for n, it in first.items() if "value" in it}
    assert first["lst"]["shape"] == "len 3" and first["num"]["shape"] is None
    assert first["guarded"]["type"] == "Guarded" and first["guarded"]["size"] > 0  # no user code
    _, second, _ = out["second"]
    # Changed in place (whole, sampled, Fortran order, strided) or mutated: changed; rebound to
    # equal numbers, strings and containers of them: unchanged.
    assert {n for n, it in second.items() if it["changed"]} == \
        {"small", "big", "fortran", "strided", "dct", "grid", "box"}
    assert second["dct"]["value"] == "{'k': [1, 2]}" and second["grid"]["value"] == "[[1, 2], [7, 4]]"
    # huge (5000 items, past what is walked) changed at its end: not seen, and marked partial
    assert not second["huge"]["changed"] and second["huge"]["partial"]
    _, after, _ = out["after_forget"]
    assert {n for n, it in after.items() if it["changed"]} == \
        {"small", "big", "fortran", "strided", "dct", "grid", "box", "text"}
    _, many, truncated = out["many"]
    assert truncated and len(many) == 500
    assert many["v599"]["changed"] and many["zzz"]["changed"]  # changed ones are kept first
    assert sum(it["changed"] for it in many.values()) == 2


# --- against a real server and kernel ---------------------------------------------------------

async def _fails(nb, code: str, reason: str) -> dict:
    """Run ``code`` as a cell that must fail with a MagicError of ``reason``: an error output,
    ``execute_reply`` status "error" (on which the kernel aborts the cells queued behind it, as
    Run All queues them), and the rest of the cell not run."""
    out = await nb.collect(nb.send_execute(f"{code}\nafter_the_failure = True"))
    assert out["reply"]["status"] == "error", out
    assert out["reply"]["ename"] == "MagicError", out
    assert out["error"].startswith("MagicError: "), out  # shown as an error output
    assert out["reply"]["traceback"][-1].endswith(f"({reason})"), out
    assert await nb.value("'after_the_failure' in globals()") is False
    return out


@needs_helper
@pytest.mark.timeout(240)
async def test_ipythons_history_is_ipythons(notebook, tmp_path):
    nb = notebook
    await nb.execute("first_line = 1")
    count = (await nb.execute("second_line = 2"))["reply"]["execution_count"]
    out = await nb.execute(f"%history -n {count}")
    assert out["stdout"].strip() == f"{count}: second_line = 2", out
    target = tmp_path / "saved.py"
    await nb.execute(f"%hist -f {target}")
    assert "second_line = 2" in target.read_text()
    registry = json.loads(await nb.value(
        "__import__('json').dumps({name: sorted(m.magics['line']) for name, m in "
        "get_ipython().magics_manager.registry.items()})"))
    ours = set(registry.pop("InfinijupMagics"))
    assert ours == {"snapshot", "restore", "snapshots", "branch", "hibernate", "sidecar",
                                  "autosnapshot", "undo", "redo"}
    assert not ours & set().union(*map(set, registry.values()))
    out = await nb.execute("%snapshots")
    assert out["stdout"].startswith("(no snapshots yet")


@needs_helper
@pytest.mark.timeout(240)
async def test_failing_magics_fail_the_cell(notebook):
    nb = notebook
    await nb.execute("kept = 'state'")
    out = await _fails(nb, "%restore deadbeefdeadbeef", "unknown_ref")
    assert "Restore failed" in out["error"]
    await _fails(nb, "%snapshot -t ../bad", "bad_thread_name")
    await _fails(nb, "%snapshots --all", "bad_request")
    out = await nb.execute("%snapshot -m one")
    assert out["stdout"].startswith("Snapshot ")
    commit = (await nb.history())["commits"][0]["id"]
    await nb.execute("%branch side")
    await _fails(nb, "%branch side", "thread_exists")
    await _fails(nb, f"%restore {commit[:12]} -b side", "thread_exists")
    await _fails(nb, f"%branch main {commit[:12]}", "thread_exists")
    await _fails(nb, f"%restore {commit[:12]} -b ../bad", "bad_thread_name")
    # Nothing of that moved the kernel: no restore ran, and the last good cell's state is here.
    assert await nb.value("kept") == "state"
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    assert (json.loads(r.body)["last_operation"] or {}).get("op") == "snapshot"


@needs_helper
@pytest.mark.timeout(240)
async def test_snapshots_shows_the_fork(notebook):
    nb = notebook
    await nb.execute("%snapshot -m A")
    a = (await nb.history())["commits"][0]["id"]
    await nb.execute("%snapshot -m B")
    await nb.restore(a)
    await nb.execute("%snapshot -m C")
    text = (await nb.execute("%snapshots"))["stdout"]
    rows = [line.split("  ")[0] for line in text.splitlines()]
    assert rows == ["*", "| *", "|/", "*"], text
    assert text.splitlines()[0].endswith("  C") and text.splitlines()[-1].endswith("  A")


# --- commits that describe themselves -----------------------------------------------------------

CELLS = [
    "import numpy as np\nsmall = np.arange(1000)\nbig = np.zeros(2**22)",
    "n = 5; text = 'hello'; items = [1, 2, 3]; table = {'a': 1}",
    "def f(v):\n    return v + 1",
    "\n\n# comment first\nblob = b'x' * 100; _private = 1",
]


def _variables(commit: dict) -> dict[str, dict]:
    meta = commit["metadata"]
    assert set(meta["variables"]) == {"items", "truncated"} and meta["variables"]["truncated"] is False
    items = meta["variables"]["items"]
    assert [it["name"] for it in items] == sorted(it["name"] for it in items)
    for it in items:
        assert {"name", "type", "size", "shape", "fp", "changed"} <= set(it) <= \
            {"name", "type", "size", "shape", "fp", "changed", "value", "partial"}, it
    return {it["name"]: it for it in items}


async def _latest(nb) -> dict:
    return (await nb.history())["commits"][0]


@needs_helper
@pytest.mark.timeout(300)
async def test_commits_carry_their_cell_and_variables(notebook):
    nb = notebook
    for cell in CELLS:
        reply = (await nb.execute(cell))["reply"]
    first = await nb.snapshot()
    c1 = await _latest(nb)
    assert c1["id"] == first["commit"] and c1["message"] == ""
    assert c1["metadata"]["cell"] == {"execution_count": reply["execution_count"],
                                      "source": "# comment first"}
    v1 = _variables(c1)
    assert set(v1) == {"small", "big", "n", "text", "items", "table", "f", "blob"}  # no np, _...
    assert all(it["changed"] for it in v1.values())  # the first snapshot of this kernel
    assert v1["small"] == {**v1["small"], "type": "ndarray", "size": 8000, "shape": "(1000,)"}
    assert v1["big"]["size"] == 8 * 2**22 and v1["big"]["shape"] == "(4194304,)"
    assert v1["items"]["type"] == "list" and v1["items"]["shape"] == "len 3"
    assert v1["n"]["type"] == "int" and v1["f"]["type"] == "function" and v1["blob"]["type"] == "bytes"

    # Change a few things, in place and by rebinding; rebinding an equal value is no change.
    await nb.execute("small[3] = -1; big[:] = 1.0; items.append(4); n = 5; text = 'hel' + 'lo'")
    await nb.execute("newcomer = 1.5")
    await nb.snapshot(message="second")
    c2 = await _latest(nb)
    assert c2["message"] == "second"
    v2 = _variables(c2)
    changed = {name for name, it in v2.items() if it["changed"]}
    assert changed == {"small", "big", "items", "newcomer"}, changed
    assert v2["n"]["fp"] == v1["n"]["fp"] and v2["small"]["fp"] != v1["small"]["fp"]

    # Back to the first snapshot: the next one is compared with it, its parent.
    await nb.restore(first["commit"])
    await nb.execute("table['b'] = 2")
    await nb.snapshot()
    c3 = await _latest(nb)
    assert c3["parents"] == [first["commit"]]
    assert {name for name, it in _variables(c3).items() if it["changed"]} == {"table"}


@needs_helper
@pytest.mark.timeout(300)
async def test_the_magic_describes_its_own_cell(notebook):
    nb = notebook
    await nb.execute("alpha = 1")
    out = await nb.execute("beta = 2\n%snapshot")
    assert out["stdout"].startswith("Snapshot ")
    c1 = await _latest(nb)
    assert c1["metadata"]["cell"] == {"execution_count": out["reply"]["execution_count"],
                                      "source": "beta = 2"}
    assert set(_variables(c1)) == {"alpha", "beta"}
    await nb.execute("beta = 3")
    await nb.execute("%snapshot -m again")
    v2 = _variables(await _latest(nb))
    assert {n for n, it in v2.items() if it["changed"]} == {"beta"}


@needs_helper
@pytest.mark.timeout(300)
async def test_a_failed_snapshot_leaves_the_parent_to_compare_with(notebook, jp_serverapp,
                                                                      monkeypatch):
    nb = notebook
    await nb.execute("kept = 1; moved = 1")
    await nb.snapshot()
    await nb.execute("moved = 2")
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    real_engine = manager.engine

    class StoreFull:
        def snapshot(self, *args, **kwargs):
            raise SnapshotFailed("the store's disk is full (injected)", reason="no_space")

    monkeypatch.setattr(manager, "engine", lambda: StoreFull())
    r = await nb.post("snapshot", {"kernel_id": nb.kernel_id})
    assert r.code >= 500 and json.loads(r.body)["reason"] == "no_space", r.body
    monkeypatch.setattr(manager, "engine", real_engine)
    await nb.snapshot()
    v = _variables(await _latest(nb))
    assert {n for n, it in v.items() if it["changed"]} == {"moved"}  # still against the parent


@needs_helper
async def test_percent_snapshot_says_its_id_once_stored(notebook):
    """Issue 28, item 9: without -w, %snapshot returns once the kernel is dumped (the id is
    not known yet); a line under it says "Storing it..." and is updated in place with the id
    when the store has the commit."""
    import asyncio
    import time

    nb = notebook
    msg_id = nb.send_execute("%snapshot -m quick")
    display_id, stdout, text, idle = None, "", None, False
    deadline = time.monotonic() + 120
    while not (idle and text and text.startswith("Stored as ")):
        raw = await asyncio.wait_for(nb.ws.read_message(), deadline - time.monotonic())
        msg = json.loads(raw)
        kind, content = msg["msg_type"], msg["content"]
        mine = msg.get("parent_header", {}).get("msg_id") == msg_id
        if kind == "stream" and mine:
            stdout += content["text"]
        elif kind == "display_data" and mine:
            display_id = content["transient"]["display_id"]
            text = content["data"]["text/plain"]
        elif kind == "update_display_data" and display_id and \
                content["transient"]["display_id"] == display_id:
            text = content["data"]["text/plain"]  # from the kernel's thread, any parent
        elif kind == "status" and mine and content["execution_state"] == "idle":
            idle = True
    assert stdout.startswith("Snapshot taken on thread 'main'"), stdout
    commit = (await nb.history())["commits"][0]["id"]
    assert text.startswith(f"Stored as {commit[:12]} ("), text


@needs_helper
async def test_the_commit_keeps_the_values_and_partial_marks_compare_shows(notebook):
    """End to end (the server checks what a kernel sends field by field): a commit's
    variables keep their short values and the mark of one too large to look at fully."""
    nb = notebook
    await nb.execute("counter = 111\nname = 'before'\nhuge = list(range(5000))")
    await nb.snapshot(message="values")  # through the server's quiesce
    await nb.execute("%snapshot -m 'from the magic'")  # through the magic's own request
    for commit in (await nb.history())["commits"]:
        items = {it["name"]: it for it in commit["metadata"]["variables"]["items"]}
        assert items["counter"]["value"] == "111", (commit["message"], items["counter"])
        assert items["name"]["value"] == "'before'", items["name"]
        assert items["huge"].get("partial") is True and "value" not in items["huge"], \
            items["huge"]
