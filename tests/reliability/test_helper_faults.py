"""SIGKILL of the privileged helper at each point of a snapshot and a restore, and helper
restarts while kernels run. Real server, real helper, real kernels holding 300 MiB, real CRIU.

After each fault: ``infinijup store check --read-data`` passes, no partial commit is visible,
the kernel runs with its state intact, and, with a helper started again on the same socket and
work dir, the next snapshot and restore work.

Each kill happens at the phase it names, never after a delay: the test waits for the server's
phase event, for a file a hook writes, or for one of the helper's hold points
(infinijup_helper/holds.py), where the helper (or CRIU) waits until the test lets it go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import psutil
import pytest
from reliakit import (
    OperationEvents,
    assert_store_ok,
    fill,
    ipykernel_pid,
    needs_helper,
    provisioner,
    state_intact,
    store_state,
    until,
    wait_gone,
    wait_restarted,
)

pytestmark = [needs_helper, pytest.mark.timeout(240)]

MIB = 300


async def prepare(nb, seed: int) -> tuple[str, dict]:
    """A first snapshot (so the store exists and has history), then 300 MiB of new data."""
    await nb.execute("x = 'base'")
    base = await nb.snapshot(message="base")
    digest = await fill(nb, MIB, seed)
    await nb.execute("x = 'current'")
    return digest, base


async def _memory_back(nb) -> None:
    """Until a lazily restored kernel's memory is all back: its page files stay in the
    helper's staging dir while CRIU's daemon serves them (infinijup_helper/lazy_pages.py)."""
    deadline = time.monotonic() + 120  # hang guard only
    while True:
        r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
        pages = json.loads(r.body).get("pages")
        if not pages or pages.get("state") != "streaming":
            return
        assert time.monotonic() < deadline, pages
        await asyncio.sleep(0.1)


async def next_snapshot_and_restore_work(nb, rhelper, digest: str) -> None:
    """A helper serving again, the next snapshot and a restore of it work."""
    rhelper.ensure_running()
    await _memory_back(nb)  # (a restore by the new helper may still be streaming)
    assert rhelper.staging_entries() == []  # a new helper clears what a dead one left
    await nb.execute("y = 'after'")
    snap = await nb.snapshot(message="after the fault")
    await nb.execute("y = 'changed'")
    await nb.restore(snap["commit"])
    await state_intact(nb, digest, {"x": "current", "y": "after"})
    assert rhelper.user_entries() == {"images": [], "restore": []}


async def test_helper_killed_during_quiesce(notebook, jp_serverapp, rhelper, store_path,
                                           tmp_path):
    """Killed while the kernel's quiesce hook runs (the hook waits for the test's go)."""
    nb = notebook
    digest, _ = await prepare(nb, seed=21)
    entered, go = tmp_path / "quiescing", tmp_path / "go"
    await nb.execute(
        "import os, pathlib, time\nfrom infinijup.kernel_magics import register_quiesce_hook\n"
        "def _hold():\n"
        f"    pathlib.Path({str(entered)!r}).touch()\n"
        f"    while not os.path.exists({str(go)!r}):\n"
        "        time.sleep(0.005)\n"
        "register_quiesce_hook(_hold)")
    before = store_state(store_path)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    await until(entered.exists, 120, "the quiesce hook to run")
    rhelper.kill()
    go.touch()
    r = await task
    assert r.code == 503, r.body
    body = json.loads(r.body)
    assert body["reason"] == "helper_unavailable" and "sudo make helper" in body["message"]
    assert store_state(store_path) == before
    assert_store_ok(store_path)
    await state_intact(nb, digest, {"x": "current"})
    await next_snapshot_and_restore_work(nb, rhelper, digest)


async def test_helper_killed_during_criu_dump(notebook, jp_serverapp, rhelper, store_path):
    """Killed once CRIU has started dumping (its log is written): CRIU, orphaned, ends (it
    finishes, or stops at its next notification to the dead helper) and lets the kernel go.
    The helper holds CRIU's answer back (hold point), so the server can only learn of the
    dump from the helper's death, even should CRIU finish before the kill."""
    nb = notebook
    digest, _ = await prepare(nb, seed=22)
    before = store_state(store_path)
    rhelper.holds.arm("criu_dump_request", "criu_dump_response")
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    criu = psutil.Process((await rhelper.holds.reached("criu_dump_request"))["criu_pid"])
    rhelper.holds.release("criu_dump_request")
    log = await until(lambda: staged_file(rhelper, "dump", "criu.log"), 120, "CRIU to start dumping")
    rhelper.kill()
    r = await task
    assert r.code == 500, r.body
    assert json.loads(r.body)["reason"] == "helper_disconnected"
    # The orphaned CRIU ends and lets the kernel go: the kernel is not left frozen.
    wait_gone([criu])
    print(f"orphaned CRIU: {open(log).read().splitlines()[-1]}")
    await state_intact(nb, digest, {"x": "current"})
    assert store_state(store_path) == before
    assert_store_ok(store_path)
    await next_snapshot_and_restore_work(nb, rhelper, digest)


async def test_helper_killed_during_store_ingest(notebook, jp_serverapp, rhelper, store_path):
    """The helper has done its part when ingest runs: the snapshot completes without it."""
    nb = notebook
    digest, base = await prepare(nb, seed=23)
    before = store_state(store_path)
    events = OperationEvents(jp_serverapp)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    await events.wait(nb.kernel_id, {"store"})  # (the helper has answered: killed during or
    rhelper.kill()                               # after the ingest, the answer is the same)
    r = await task
    assert r.code == 201, r.body
    snap = json.loads(r.body)
    after = store_state(store_path)
    assert after["commits"] == sorted(before["commits"] + [snap["commit"]])
    assert_store_ok(store_path)
    await state_intact(nb, digest, {"x": "current"})
    rhelper.ensure_running()
    await nb.execute("x = 'changed'")
    await nb.restore(snap["commit"])  # the commit made while the helper died is whole
    await state_intact(nb, digest, {"x": "current"})
    await next_snapshot_and_restore_work(nb, rhelper, digest)


async def test_helper_killed_during_restore_checkout(notebook, jp_serverapp, rhelper,
                                                     store_path, monkeypatch):
    """Killed before the kernel is touched: the running kernel is kept, the reason shown."""
    from infinijup.store import checkout

    # the images must come out of the store (not the hot tier, engine/hot_tier.py)
    jp_serverapp.web_app.settings["infinijup_manager"].hot_tier_bytes = 0
    nb = notebook
    # no hot copy: the restore must check the images out of the store, where it is caught
    monkeypatch.setattr(jp_serverapp.web_app.settings["infinijup_manager"], "hot_tier_bytes", 0)
    digest, _ = await prepare(nb, seed=24)
    big = await nb.snapshot(message="300 MiB to check out")
    root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    before = store_state(store_path)
    # The checkout (in the server, a worker thread) waits at its start for the test's go.
    checking_out, go = threading.Event(), threading.Event()
    checkout_dir = checkout.checkout_dir

    def held(repo, *args, **kwargs):
        checking_out.set()
        assert go.wait(120)
        return checkout_dir(repo, *args, **kwargs)

    monkeypatch.setattr(checkout, "checkout_dir", held)
    task = asyncio.ensure_future(nb.post("restore", {"kernel_id": nb.kernel_id,
                                                     "commit": big["commit"]}))
    await until(checking_out.is_set, 120, "the restore to start checking out")
    rhelper.kill()
    go.set()
    r = await task
    assert r.code == 500, r.body
    body = json.loads(r.body)
    assert body["reason"] == "helper_unavailable" and "sudo make helper" in body["message"]
    assert provisioner(jp_serverapp, nb.kernel_id).root_pid == root
    await state_intact(nb, digest, {"x": "current"})
    assert store_state(store_path) == before
    assert_store_ok(store_path)
    await next_snapshot_and_restore_work(nb, rhelper, digest)


async def start_restore_to_interrupt(nb, jp_serverapp, rhelper, store_path, seed: int,
                                     *holds: str):
    """A kernel with 300 MiB snapshotted as x == 'snapshotted', then moved on; a restore of
    that snapshot is started and, when this returns, the old kernel is gone, CRIU runs and the
    helper waits at its hold point ``criu_restore_request`` (not sent CRIU its request yet).
    ``holds``: more hold points to arm."""
    digest, _ = await prepare(nb, seed=seed)
    await nb.execute("x = 'snapshotted'")
    snap = await nb.snapshot(message="to restore")
    await nb.execute("x = 'moved on'")
    ctx = {"digest": digest, "snap": snap, "before": store_state(store_path),
           "old_root": provisioner(jp_serverapp, nb.kernel_id).root_pid}
    rhelper.holds.arm("criu_restore_request", *holds)
    ctx["task"] = asyncio.ensure_future(nb.post("restore", {"kernel_id": nb.kernel_id,
                                                            "commit": snap["commit"]}))
    ctx["criu_pid"] = (await rhelper.holds.reached("criu_restore_request"))["criu_pid"]
    ctx["criu"] = [psutil.Process(ctx["criu_pid"])]
    # a lazy restore's page daemon, started before CRIU: it must not outlive the restore
    ctx["daemons"] = page_daemons(rhelper.pid)
    return ctx


def page_daemons(helper_pid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(helper_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # (a zombie: the kernel the restore ended)
            if "lazy-pages" in p.cmdline():
                found.append(p)
    return found


async def check_interrupted_restore(nb, jp_serverapp, rhelper, store_path, ctx) -> str:
    """What must hold after the helper died mid-restore, whichever way it went: either the
    tree CRIU restored was adopted (the restore completed) or nothing was restored, the
    kernel is reported dead with the reason and restarts once the helper is back. Never an
    untracked kernel holding the notebook's endpoints. Returns "adopted" or "restarted"."""
    r = await ctx["task"]
    wait_gone(ctx["criu"])
    km = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id)
    info = km.get_connection_info()
    port = f"{info['ip']}-{info['shell_port']}"  # the shell endpoint (an ipc socket path)
    assert not psutil.pid_exists(ctx["old_root"])
    if r.code == 200:
        outcome = "adopted"
        assert json.loads(r.body)["phases"]["adopted"] is True
        root = provisioner(jp_serverapp, nb.kernel_id).root_pid
        assert listeners(port) == [ipykernel_pid(root)]
        await state_intact(nb, ctx["digest"], {"x": "snapshotted"})
    else:
        outcome = "restarted"
        assert r.code == 500, r.body
        body = json.loads(r.body)
        assert body["reason"] == "helper_disconnected", body
        assert "restarting the kernel failed too" in body["message"], body
        assert listeners(port) == []  # nothing half-restored holds the endpoints
        model = json.loads((await nb.fetch("api", "kernels", nb.kernel_id)).body)
        assert model["execution_state"] == "dead" and "helper" in model["reason"], model
        rhelper.ensure_running()
        r = await nb.fetch("api", "kernels", nb.kernel_id, "restart", method="POST", body="")
        assert r.code == 200
        await wait_restarted(nb, jp_serverapp, ctx["old_root"])
        assert await nb.value("globals().get('x')") is None  # a fresh kernel
        await nb.restore(ctx["snap"]["commit"])  # and the snapshot is there for it
        await state_intact(nb, ctx["digest"], {"x": "snapshotted"})
    assert store_state(store_path) == ctx["before"]
    assert_store_ok(store_path)
    # its page daemon served the adopted tree and exited, or (its restore never came) the
    # helper that started next told it to give up: none is left listening
    wait_gone(ctx["daemons"])
    await nb.execute("x = 'current'")
    await next_snapshot_and_restore_work(nb, rhelper, ctx["digest"])
    return outcome


async def test_helper_killed_after_criu_restored(notebook, jp_serverapp, rhelper, store_path):
    """The worst moment: CRIU has restored the tree (the old kernel is gone) but the helper
    dies before it answers. The server finds the restored tree and adopts it."""
    ctx = await start_restore_to_interrupt(notebook, jp_serverapp, rhelper, store_path, 25,
                                           "criu_restore_response")
    rhelper.holds.release("criu_restore_request")
    await rhelper.holds.reached("criu_restore_response")  # CRIU answered; the helper holds it
    rhelper.kill()
    outcome = await check_interrupted_restore(notebook, jp_serverapp, rhelper, store_path, ctx)
    assert outcome == "adopted"


async def test_helper_and_criu_killed_at_criu_start(notebook, jp_serverapp, rhelper,
                                                    store_path):
    """The helper and its CRIU die together (as a service manager kills a whole cgroup) as
    CRIU starts: the old kernel is gone and nothing was restored."""
    ctx = await start_restore_to_interrupt(notebook, jp_serverapp, rhelper, store_path, 26)
    for proc in ctx["criu"]:
        proc.kill()
    rhelper.kill()
    outcome = await check_interrupted_restore(notebook, jp_serverapp, rhelper, store_path, ctx)
    assert outcome == "restarted"


async def test_helper_killed_during_criu_restore(notebook, jp_serverapp, rhelper, store_path):
    """A plain SIGKILL of the helper once CRIU has started restoring (its log is written). The
    helper holds CRIU's answer back (hold point), so the server learns nothing but the
    helper's death. Depending on how far CRIU got, the tree dies with the helper (its parent)
    or CRIU restores it on its own: either outcome must be handled (check_interrupted_restore;
    the next two tests force each one)."""
    ctx = await start_restore_to_interrupt(notebook, jp_serverapp, rhelper, store_path, 27,
                                           "criu_restore_response")
    rhelper.holds.release("criu_restore_request")
    await until(lambda: staged_file(rhelper, "restore", "restore.log"), 120, "CRIU to start restoring")
    rhelper.kill()
    outcome = await check_interrupted_restore(notebook, jp_serverapp, rhelper, store_path, ctx)
    print(f"helper killed during CRIU restore: {outcome}")


async def test_helper_killed_when_criu_created_the_tree(notebook, jp_serverapp, rhelper,
                                                        store_path):
    """A plain SIGKILL of the helper while CRIU restores, the tree created but not yet
    resumed (CRIU waits at its post-restore notification): the tree dies with its parent, the
    helper, and the server reports the kernel dead and restarts it later."""
    ctx = await start_restore_to_interrupt(notebook, jp_serverapp, rhelper, store_path, 28,
                                           "criu_restore_post-restore")
    rhelper.holds.release("criu_restore_request")
    tree = (await rhelper.holds.reached("criu_restore_post-restore"))["pid"]
    assert psutil.Process(tree).ppid() == rhelper.pid  # created, a child of the helper
    rhelper.kill()
    outcome = await check_interrupted_restore(notebook, jp_serverapp, rhelper, store_path, ctx)
    assert outcome == "restarted"


def staged_file(rhelper, prefix: str, name: str) -> str | None:
    """The helper's staging dir of a dump or restore (``<work>/.staging/PREFIX-*``) when
    ``name`` is in it (CRIU's log: CRIU has opened the dir and runs)."""
    root = os.path.join(rhelper.work_dir, ".staging")
    for entry in os.listdir(root):
        path = os.path.join(root, entry, name)
        if entry.startswith(prefix + "-") and os.path.exists(path):
            return path
    return None


def listeners(path: str) -> list[int]:
    """Pids of the processes holding a unix socket listening on ``path``."""
    from infinijup.unix_diag import TCP_LISTEN, own_socket_inodes, unix_sockets

    inodes = {s.inode for s in unix_sockets().values()
              if s.state == TCP_LISTEN and s.name == path}
    holders = []
    for proc in psutil.process_iter():
        try:
            if own_socket_inodes(proc.pid) & inodes:
                holders.append(proc.pid)
        except OSError:
            continue
    return holders


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
async def test_helper_restart_while_kernels_run(open_notebook, jp_serverapp, rhelper,
                                                store_path, sig, tmp_path):
    """Two kernels run; the helper stops (cleanly or killed) and starts again: both kernels
    keep running and can be snapshotted, restored, interrupted and shut down."""
    a = await open_notebook("a.ipynb")
    b = await open_notebook("b.ipynb")
    await a.execute("v = 'a'")
    await b.execute("v = 'b'")
    snap_a = await a.snapshot()
    roots = {nb.kernel_id: provisioner(jp_serverapp, nb.kernel_id).root_pid for nb in (a, b)}
    if sig == signal.SIGKILL:
        rhelper.kill()
    else:
        rhelper.stop()
    for nb in (a, b):  # kernels are not the helper's: they run on without it
        assert await nb.value("v") == nb.path[0]
    rhelper.ensure_running()
    for nb in (a, b):
        assert provisioner(jp_serverapp, nb.kernel_id).root_pid == roots[nb.kernel_id]
        await nb.execute("w = 1")
        snap = await nb.snapshot(message="after the helper restart")
        await nb.execute("w = 2")
        await nb.restore(snap["commit"])
        assert await nb.value("(v, w)") == (nb.path[0], 1)
    # the snapshot from before the restart restores too, and interrupting still works
    await a.restore(snap_a["commit"])
    assert await a.value("v") == "a"
    running = tmp_path / "running"
    cell = b.send_execute(f"import pathlib, time; pathlib.Path({str(running)!r}).touch(); "
                          "time.sleep(600)")
    await until(running.exists, 120, "the cell to run")
    r = await b.fetch("api", "kernels", b.kernel_id, "interrupt", method="POST", body="")
    assert r.code == 204
    out = await b.collect(cell, timeout=120)
    assert out["error"] and "KeyboardInterrupt" in out["error"]
    assert_store_ok(store_path)
