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

from infinijup.gpu.room_plan import host_memory, margin_for

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


async def test_a_release_moves_pytorchs_memory_through_the_arena(notebook, jp_serverapp):
    """Issue 27: PyTorch's segments leave through the kernel's VMM arena (copy-engine speed),
    the driver's checkpoint takes only the rest, and the next cell finds every byte back."""
    nb = notebook
    await nb.execute(FILL.format(seed=3, n=4 * 2**30), timeout=600)
    await _idle_everywhere(jp_serverapp, nb)

    async def gpu_of() -> dict | None:  # /infinijup/status says where the memory is
        r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
        return json.loads(r.body)["gpu"]

    on_gpu = await gpu_of()
    assert on_gpu["where"] == "gpu" and on_gpu["bytes"] > 4 * 2**30, on_gpu
    r = await nb.post("release", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    released = json.loads(r.body)
    assert released["state"] == "released"
    assert released["gpu"]["arena"]["bytes"] >= 4 * 2**30, released  # not the driver's copy
    assert _held(jp_serverapp, nb) == 0
    assert await gpu_of() == {**on_gpu, "where": "host"}
    t0 = time.perf_counter()
    assert await nb.value(CHECK) is True
    print(f"\nrelease of 4 GiB through the arena: {released['gpu']['arena']['seconds']:.2f} s "
          f"moved; first cell after it answered in {time.perf_counter() - t0:.2f} s")
    assert await _state(nb) == "running"
    assert _held(jp_serverapp, nb) > 4 * 2**30


async def test_a_release_the_driver_refuses_leaves_the_kernel_running_with_its_memory(
        notebook, jp_serverapp, monkeypatch):
    """The segments are in the arena when the driver's step fails: they come back, and the
    kernel runs on as it was, on the GPU."""
    nb = notebook
    await nb.execute(FILL.format(seed=4, n=2**30), timeout=600)
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    seen = {}

    async def driver_refuses(kernel_id):
        seen["held"] = _held(jp_serverapp, nb)  # the offload has run: the segments are out
        raise RuntimeError("the driver refused the checkpoint")

    monkeypatch.setattr(manager, "release_gpu", driver_refuses)
    await _idle_everywhere(jp_serverapp, nb)
    r = await nb.post("release", {"kernel_id": nb.kernel_id})
    assert r.code >= 400, r.body
    assert seen["held"] < 2**30  # the segments had left for the arena
    assert await _state(nb) == "running"
    assert _held(jp_serverapp, nb) > 2**30  # back on the GPU, before any cell
    assert await nb.value(CHECK) is True


async def test_two_kernels_of_sixty_percent_alternate(jp_fetch, jp_ws_fetch, jp_serverapp,
                                                      infinijup_kernelspec):
    from infinijup.gpu.room import free_by_gpu

    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.gpu_release_after = 60.0
    total = max(free_by_gpu().values())
    n = int(0.6 * total)
    available, host_total = host_memory()
    if 2 * n + margin_for(host_total) > available:
        # a switch holds one kernel released while the other is released too
        pytest.skip(f"host memory ({available / 1e9:.0f} GB available) cannot hold two kernels "
                    f"of {n / 1e9:.0f} GB at once: such kernels cannot take turns here (an "
                    "H200's 141 GB against 128 GiB of RAM); test_a_wake_host_memory_cannot_"
                    "make_room_for covers what happens then")
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


async def test_a_wake_host_memory_cannot_make_room_for(jp_fetch, jp_ws_fetch, jp_serverapp,
                                                       infinijup_kernelspec):
    """Issue 27's H200 case, scaled to the GPU: K1 (35% of the GPU) released, K2 (3%) and K3
    (70%) idle on it. K1's next cell needs room: K3 gives way if host memory can hold its
    bytes beside K1's; if not, nothing is released and the cell gets the reason. Either way
    no kernel loses its state, and nothing is restarted."""
    from infinijup.gpu.room import free_by_gpu

    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.gpu_release_after = 60.0
    total = max(free_by_gpu().values())
    sizes = {"k1": int(0.35 * total), "k2": int(0.03 * total), "k3": int(0.70 * total)}
    nbs = {}
    try:
        for i, (name, n) in enumerate(sizes.items()):
            nbs[name] = await Notebook(jp_fetch, jp_ws_fetch, f"{name}.ipynb").start(
                infinijup_kernelspec)
            if name == "k3":  # K1 first gives the GPU back (the policy, an hour idle)
                await _idle_everywhere(jp_serverapp, *nbs.values())
                await manager.hibernation.release(nbs["k1"].kernel_id)
                assert await _state(nbs["k1"]) == "released"
            await nbs[name].execute(FILL.format(seed=i + 1, n=n), timeout=600)
        roots = {k: jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
                 for k, nb in nbs.items()}
        await _idle_everywhere(jp_serverapp, nbs["k2"], nbs["k3"])
        available, host_total = host_memory()
        k3_fits = sizes["k3"] + margin_for(host_total) <= available
        out = await nbs["k1"].execute(CHECK, timeout=600) if k3_fits else None
        if k3_fits:
            assert out["error"] is None, out
            assert await _state(nbs["k3"]) == "released"
        else:
            msg_id = nbs["k1"].send_execute(CHECK)
            answer = await nbs["k1"].collect(msg_id, timeout=600)
            assert answer["error"] is not None, answer
            assert "host memory" in answer["error"] and "k3.ipynb" in answer["error"], answer
            assert await _state(nbs["k1"]) == "released"  # still resting, resumable
            assert await _state(nbs["k3"]) == "running"
        print(f"\nhost memory {available / 1e9:.0f} GB available, K3 {sizes['k3'] / 1e9:.0f} GB:"
              f" {'K3 gave way' if k3_fits else 'refused: ' + answer['error']}")
        for name in ("k2", "k3"):  # never restarted, state intact
            prov = jp_serverapp.kernel_manager.get_kernel(nbs[name].kernel_id).provisioner
            assert prov.root_pid == roots[name] and prov.launches == 1
            assert await nbs[name].value(CHECK) is True
    finally:
        for nb in nbs.values():
            await nb.close()


async def test_a_running_kernels_allocation_gets_room_from_an_idle_kernel(
        jp_fetch, jp_ws_fetch, jp_serverapp, infinijup_kernelspec):
    """Issue 27: a notebook that loads a tensor while another idles on the GPU gets the memory
    (the VMM allocator asks the server, which releases the idle kernel) instead of CUDA's
    out-of-memory error; then the idle one's next cell brings it back (the other giving way in
    turn). Every byte intact."""
    from infinijup.gpu.room import free_by_gpu

    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    total = max(free_by_gpu().values())
    n = int(0.55 * total)
    available, host_total = host_memory()
    if 2 * n + margin_for(host_total) > available:
        # the idle kernel's wake holds it in host memory while the runner is released too
        pytest.skip(f"host memory ({available / 1e9:.0f} GB available) cannot hold two kernels "
                    f"of {n / 1e9:.0f} GB at once: the runner could not give way to the idle "
                    "kernel's wake here (an H200's 141 GB against 128 GiB of RAM)")
    nbs = {}
    try:
        for name in ("idle", "runner"):
            nbs[name] = await Notebook(jp_fetch, jp_ws_fetch, f"{name}.ipynb").start(
                infinijup_kernelspec)
        await nbs["idle"].execute(FILL.format(seed=1, n=n), timeout=600)
        await _idle_everywhere(jp_serverapp, nbs["idle"])
        manager.make_room_for_running = True
        out = await nbs["runner"].execute(FILL.format(seed=2, n=n), timeout=600)
        assert "out of memory" not in out["stderr"].lower(), out
        assert await _state(nbs["idle"]) == "released"
        assert await nbs["runner"].value(CHECK) is True
        await _idle_everywhere(jp_serverapp, nbs["runner"])
        assert await nbs["idle"].value(CHECK) is True  # woken: the runner gave way
        assert await _state(nbs["runner"]) == "released"
        assert await nbs["runner"].value(CHECK) is True
    finally:
        for nb in nbs.values():
            await nb.close()
