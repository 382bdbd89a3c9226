"""Issue 27's faults on a real GPU: the helper killed in the middle of a kernel's GPU release or
reacquire, at the CUDA driver's hold points (infinijup_helper/cuda_driver.py), never after a
delay. In each case the kernel keeps every byte of its GPU memory, runs again (or stays
released and wakes on the next cell), the GPU holds no memory of a kernel that says it gave it
back, and the requester gets the reason. Skipped with the reason where there is no GPU.

The helper is restarted right after the kill, as its service manager would; the server waits
for it (``HELPER_BACK_S``) to unlock the kernel's CUDA.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal

import pytest
from reliakit import ipykernel_pid, needs_helper, provisioner

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None

pytestmark = [
    needs_helper,
    pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)"),
    pytest.mark.timeout(600),
]

FILL = """
import hashlib, torch
g = torch.Generator(device="cuda").manual_seed({seed})
t = torch.randint(0, 255, ({n},), dtype=torch.uint8, device="cuda", generator=g)
digest = hashlib.sha256(t[::4096].cpu().numpy().tobytes()).hexdigest()
"""
CHECK = "hashlib.sha256(t[::4096].cpu().numpy().tobytes()).hexdigest() == digest"
GIB = 2**30


def _held(jp_serverapp, nb) -> int:
    from infinijup.gpu.room import held_by_tree

    return sum(held_by_tree(provisioner(jp_serverapp, nb.kernel_id).root_pid).values())


async def _state(nb) -> str:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)["state"]


async def _filled(nb, jp_serverapp, seed: int) -> None:
    await nb.execute(FILL.format(seed=seed, n=GIB), timeout=600)
    assert _held(jp_serverapp, nb) > GIB
    km = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id)
    while km.execution_state != "idle":  # the server's view lags the websocket's
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("point", ["cuda_locked", "cuda_checkpointed"])
async def test_helper_killed_during_a_release(notebook, jp_serverapp, rhelper, point):
    """Killed with the kernel's CUDA locked (or checkpointed, before the helper answered): the
    release fails with the reason, the kernel's CUDA is unlocked once the helper is back, its
    segments return from the arena, and it runs on with every byte."""
    nb = notebook
    await _filled(nb, jp_serverapp, seed=31)
    rhelper.holds.arm(point)
    task = asyncio.ensure_future(nb.post("release", {"kernel_id": nb.kernel_id}))
    await rhelper.holds.reached(point)
    rhelper.kill()
    rhelper.ensure_running()
    r = await task
    assert r.code >= 500, r.body
    body = json.loads(r.body)
    assert body["reason"] == "helper_disconnected", body
    print(f"\n{point}: the release answered {r.code}: {body['message']}")
    assert await _state(nb) == "running"
    assert _held(jp_serverapp, nb) > GIB  # back on the GPU before any cell
    assert await nb.value(CHECK) is True
    # and it can still be released and woken
    r = await nb.post("release", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert _held(jp_serverapp, nb) == 0
    assert await nb.value(CHECK) is True


async def test_helper_killed_during_a_wake(notebook, jp_serverapp, rhelper):
    """Killed while the driver brings the kernel's memory back (restored, not yet unlocked):
    the cell that woke it gets the reason, the kernel stays released with its memory, and the
    next cell wakes it with every byte."""
    nb = notebook
    await _filled(nb, jp_serverapp, seed=32)
    r = await nb.post("release", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert _held(jp_serverapp, nb) == 0
    rhelper.holds.arm("cuda_restored")
    cell = asyncio.ensure_future(nb.collect(nb.send_execute("1 + 1"), 600))
    await rhelper.holds.reached("cuda_restored")
    rhelper.kill()
    rhelper.ensure_running()
    out = await cell
    assert out.get("error") and "could not wake" in json.dumps(out["error"]), out
    print(f"\nwake cut short: {out['error']}")
    assert await _state(nb) == "released"
    assert await nb.value(CHECK) is True  # the next cell wakes it
    assert await _state(nb) == "running"
    assert _held(jp_serverapp, nb) > GIB


async def test_kernel_killed_during_a_release(notebook, jp_serverapp, rhelper):
    """The kernel itself dies with its CUDA locked (killed from outside: its state is gone, and
    no tool could keep it). The release fails with the reason, the GPU holds nothing of the dead
    process, and the kernel is restarted fresh once the release has given up, not before."""
    from infinijup.gpu.preflight import read_nvml

    nb = notebook
    await _filled(nb, jp_serverapp, seed=33)
    prov = provisioner(jp_serverapp, nb.kernel_id)
    launches = prov.launches
    kernel = ipykernel_pid(prov.root_pid)
    rhelper.holds.arm("cuda_locked")
    task = asyncio.ensure_future(nb.post("release", {"kernel_id": nb.kernel_id}))
    await rhelper.holds.reached("cuda_locked")
    os.kill(kernel, signal.SIGKILL)
    root = prov.root_pid
    while prov.root_pid == root and prov.has_live_process():  # its tree's init follows it
        await asyncio.sleep(0.01)
    rhelper.holds.release("cuda_locked")
    r = await task
    assert r.code >= 400, r.body
    assert json.loads(r.body)["reason"] == "kernel_died", r.body
    print(f"\nkernel killed mid-release: {r.code} {json.loads(r.body)['message']}")
    assert not sum(read_nvml().usage_by_gpu({kernel}).values())  # nothing left on the GPU
    while prov.launches == launches:  # the restarter's turn comes after the failed release
        await asyncio.sleep(0.1)
    await nb.reconnect()
    assert await nb.value("'t' in dir()") is False  # a fresh kernel, and it answers
    assert await _state(nb) == "running"
