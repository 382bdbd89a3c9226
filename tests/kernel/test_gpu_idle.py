"""Idle GPU kernels (issue 14) through the real server and the notebooks' websockets, on an NVIDIA
GPU: the idle policy releases a kernel's VRAM (the GPU holds nothing of it) and its next cell
brings it back; two kernels that each need 60% of the GPU alternate cells, each wake releasing
the other, idle one first. Skipped with the reason where there is no GPU."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from kernelkit import Notebook, needs_helper

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None

pytestmark = [
    needs_helper,
    pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)"),
    pytest.mark.timeout(900),
]

FILL = """
import hashlib, torch
g = torch.Generator(device="cuda").manual_seed({seed})
t = torch.randint(0, 255, ({n},), dtype=torch.uint8, device="cuda", generator=g)
digest = hashlib.sha256(t[::4096].cpu().numpy().tobytes()).hexdigest()
"""
CHECK = "hashlib.sha256(t[::4096].cpu().numpy().tobytes()).hexdigest() == digest"


def _held(jp_serverapp, nb) -> int:
    from infinijup.gpu.room import held_by_tree

    root = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
    return sum(held_by_tree(root).values())


async def _state(nb) -> str:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)["state"]


async def _idle_everywhere(jp_serverapp, *nbs) -> None:
    """Wait until the server sees each kernel idle (its view lags the websocket's)."""
    import asyncio

    for nb in nbs:
        while jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).execution_state != "idle":
            await asyncio.sleep(0.01)


async def test_idle_policy_releases_the_gpu_and_the_next_cell_brings_it_back(
        notebook, jp_serverapp):
    nb = notebook
    await nb.execute(FILL.format(seed=1, n=2 * 2**30), timeout=600)
    assert _held(jp_serverapp, nb) > 2 * 2**30
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.gpu_release_after = 60.0
    await _idle_everywhere(jp_serverapp, nb)
    await manager.hibernation.tick(time.time() + 3600)  # an hour idle, as the policy sees it
    assert await _state(nb) == "released"
    assert _held(jp_serverapp, nb) == 0
    t0 = time.perf_counter()
    assert await nb.value(CHECK) is True
    print(f"\nwake after GPU release (2 GiB): first cell answered in "
          f"{time.perf_counter() - t0:.2f} s")
    assert await _state(nb) == "running"
    assert _held(jp_serverapp, nb) > 2 * 2**30


async def test_two_kernels_of_sixty_percent_alternate(jp_fetch, jp_ws_fetch, jp_serverapp,
                                                      infinijup_kernelspec):
    from infinijup.gpu.room import free_by_gpu

    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.gpu_release_after = 60.0
    total = max(free_by_gpu().values())
    n = int(0.6 * total)
    a = await Notebook(jp_fetch, jp_ws_fetch, "a.ipynb").start(infinijup_kernelspec)
    b = await Notebook(jp_fetch, jp_ws_fetch, "b.ipynb").start(infinijup_kernelspec)
    try:
        await a.execute(FILL.format(seed=1, n=n), timeout=600)
        # A idles; the policy releases it, and B can take its 60%
        await _idle_everywhere(jp_serverapp, a, b)
        await manager.hibernation.tick(time.time() + 3600)
        assert await _state(a) == "released"
        await b.execute(FILL.format(seed=2, n=n), timeout=600)
        # from now on each cell of one wakes it, releasing the other (idle) one first
        switches = []
        for nb, other in ((a, b), (b, a), (a, b)):
            await _idle_everywhere(jp_serverapp, a, b)
            t0 = time.perf_counter()
            assert await nb.value(CHECK) is True
            switches.append(time.perf_counter() - t0)
            assert await _state(nb) == "running"
            assert await _state(other) == "released"
        print(f"\ntwo kernels of {n / 1e9:.1f} GB each on one GPU: switch (release the other, "
              f"bring this one back, run the cell) took " +
              ", ".join(f"{s:.1f} s" for s in switches))
    finally:
        await a.close()
        await b.close()
