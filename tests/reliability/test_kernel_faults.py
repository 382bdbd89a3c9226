"""The kernel itself dies in the middle of a snapshot (SIGKILL of the real ipykernel process)."""

from __future__ import annotations

import asyncio
import json
import signal

import psutil
import pytest
from reliakit import (
    PhaseWatch,
    assert_store_ok,
    fill,
    ipykernel_pid,
    needs_helper,
    provisioner,
    state_intact,
    store_state,
    until,
    wait_restarted,
)

pytestmark = [needs_helper, pytest.mark.timeout(240)]


async def test_kernel_killed_during_criu_dump(notebook, jp_serverapp, rhelper, store_path):
    """CRIU fails, the reason is shown, nothing reaches the store; the server reports the kernel
    dead and restarts it; the next snapshot works, and an earlier one restores into it."""
    nb = notebook
    await nb.execute("x = 'base'")
    base = await nb.snapshot(message="base")
    await fill(nb, 300, seed=31)
    before = store_state(store_path)
    root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    kernel = ipykernel_pid(root)
    watch = PhaseWatch(jp_serverapp, nb.kernel_id)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    await watch.wait({"dump"})
    await until(rhelper.criu_children, 30, "CRIU to start dumping", interval=0.002)
    psutil.Process(kernel).send_signal(signal.SIGKILL)
    r = await task
    assert r.code == 500, r.body
    body = json.loads(r.body)
    assert body["reason"] == "criu_failed" and "CRIU dump failed" in body["message"], body
    assert store_state(store_path) == before
    assert_store_ok(store_path)
    assert rhelper.staging_entries() == []
    assert rhelper.user_entries() == {"images": [], "restore": []}
    # dead, noticed, restarted by the server (its restarter), and usable
    await until(lambda: not psutil.pid_exists(root) or
                psutil.Process(root).status() == psutil.STATUS_ZOMBIE, 30, "the tree to end")
    await wait_restarted(nb, jp_serverapp, root)
    assert await nb.value("globals().get('x')") is None
    await nb.execute("x = 'fresh'")
    snap = await nb.snapshot(message="after the kernel died")
    await nb.restore(base["commit"])
    assert await nb.value("x") == "base"
    await nb.restore(snap["commit"])
    assert await nb.value("x") == "fresh"
    assert_store_ok(store_path)


async def test_kernel_killed_during_store_ingest(notebook, jp_serverapp, rhelper, store_path):
    """The images are taken by then: the snapshot completes, whole, and restores into the
    kernel the server restarted."""
    nb = notebook
    digest = await fill(nb, 300, seed=32)
    await nb.execute("x = 'in the snapshot'")
    root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    kernel = ipykernel_pid(root)
    watch = PhaseWatch(jp_serverapp, nb.kernel_id)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    await watch.wait({"store"})
    psutil.Process(kernel).send_signal(signal.SIGKILL)
    r = await task
    assert r.code == 201, r.body
    snap = json.loads(r.body)
    assert_store_ok(store_path)
    await wait_restarted(nb, jp_serverapp, root)
    assert await nb.value("globals().get('x')") is None
    await nb.restore(snap["commit"])
    await state_intact(nb, digest, {"x": "in the snapshot"})
