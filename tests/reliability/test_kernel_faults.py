"""The kernel itself dies in the middle of a snapshot (SIGKILL of the real ipykernel process),
and clients connect to a kernel CRIU holds frozen. Each acts at the phase it names: CRIU waits
at a hold point (infinijup_helper/holds.py) with the tree frozen, or the server's phase event."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

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
    traced_by,
    until,
    wait_restarted,
)

pytestmark = [needs_helper, pytest.mark.timeout(240)]

FROZEN = "criu_dump_query-ext-files"  # CRIU has frozen the tree and dumped nothing yet


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
    rhelper.holds.arm(FROZEN)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    criu = (await rhelper.holds.reached(FROZEN))["criu_pid"]
    assert traced_by(kernel) == criu  # CRIU holds the kernel frozen, has dumped nothing yet
    psutil.Process(kernel).send_signal(signal.SIGKILL)
    rhelper.holds.release(FROZEN)
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
    events = OperationEvents(jp_serverapp)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    await events.wait(nb.kernel_id, {"store"})  # the images are taken: during the ingest or
    psutil.Process(kernel).send_signal(signal.SIGKILL)  # after it, the answer is the same
    r = await task
    assert r.code == 201, r.body
    snap = json.loads(r.body)
    assert_store_ok(store_path)
    await wait_restarted(nb, jp_serverapp, root)
    assert await nb.value("globals().get('x')") is None
    await nb.restore(snap["commit"])
    await state_intact(nb, digest, {"x": "in the snapshot"})


def test_connection_in_flight_during_dump(rhelper, tmp_path):
    """A client that connects while the kernel cannot accept (CRIU has it frozen; here it is
    stopped) leaves its connection "in flight" in the listen queue. Found in these tests: the
    dump then failed (`inet: In-flight connection`). Such connections are left out of the
    image now (the client sees a reset and reconnects, as ZMQ does)."""
    import socket
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helper"))
    from helperkit import Trees, start_kernel

    from infinijup.helper_client import HelperClient

    rhelper.ensure_running()
    client = HelperClient(rhelper.socket_path, timeout=120)
    trees = Trees()
    kernel = start_kernel(client, trees, name="in-flight")
    try:
        kernel.execute("x = 7")
        (proc,) = psutil.Process(kernel.pid).children()
        proc.suspend()  # SIGSTOP: the kernel accepts nothing from here on
        try:
            pending = [socket.create_connection(("127.0.0.1", kernel.kc.shell_port), timeout=5)
                       for _ in range(3)]
            images = os.path.join(client.work_dir(), f"in-flight-{kernel.pid}")
            client.dump(kernel.pid, images)
        finally:
            proc.resume()
        for s in pending:
            s.close()
        kernel.wait_answering()
        assert kernel.evaluate(x="x")["x"] == "7"
        kernel.execute("x = 8")
        restored = trees.add(client.restore(images, replace_pid=kernel.pid).pid)
        (again,) = psutil.Process(restored).children()
        assert again.status() == psutil.STATUS_STOPPED  # as it was dumped (by this test)
        again.resume()
        kernel.wait_answering()
        assert kernel.evaluate(x="x")["x"] == "7"
        client.kill(restored)
        client.release(images)
    finally:
        kernel.close()
        trees.cleanup()


async def test_clients_connecting_while_the_kernel_is_frozen(notebook, jp_serverapp, rhelper,
                                                             store_path):
    """Clients connect to the kernel's endpoints while CRIU holds it frozen (a new browser tab,
    the server's own channels reconnecting): those connections wait in the listen queue,
    "in flight", as CRIU dumps the listening sockets. The snapshot must not fail for them."""
    import socket

    nb = notebook
    digest = await fill(nb, 300, seed=33)
    await nb.execute("x = 'frozen'")
    info = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).get_connection_info()
    ports = [f"{info['ip']}-{info[k]}" for k in ("shell_port", "iopub_port", "stdin_port",
                                                 "control_port", "hb_port")]  # ipc endpoints
    kernel = ipykernel_pid(provisioner(jp_serverapp, nb.kernel_id).root_pid)
    rhelper.holds.arm(FROZEN)
    task = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    criu = (await rhelper.holds.reached(FROZEN))["criu_pid"]
    clients = []
    try:
        assert traced_by(kernel) == criu  # frozen by CRIU...
        for port in ports:
            for _ in range(3):
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                client.settimeout(30)
                client.connect(port)
                clients.append(client)
        assert traced_by(kernel) == criu  # ...all the while the clients connected
        rhelper.holds.release(FROZEN)
        r = await task
        assert r.code == 201, r.body
    finally:
        for c in clients:
            c.close()
    assert len(clients) == 3 * len(ports)
    print(f"{len(clients)} connections opened while CRIU held the kernel frozen")
    snap = json.loads(r.body)
    await nb.execute("x = 'after'")
    await nb.restore(snap["commit"])
    await state_intact(nb, digest, {"x": "frozen"})
    assert_store_ok(store_path)
