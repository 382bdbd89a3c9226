"""Making room on a GPU never costs a kernel its state (issue 27): the decision, on the CPU.

Who gives way, where the bytes go and what a refusal says, with the GPU side faked at its
boundary (NVML's numbers, /proc/meminfo's, and the helper's release): the real release and
wake run on the GPU machine (tests/kernel/test_gpu_idle.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from infinijup.engine.lifecycle import RELEASED, RELEASING, RUNNING, Lifecycle
from infinijup.errors import Conflict
from infinijup.gpu.room_plan import (
    GIB,
    Candidate,
    host_memory,
    margin_for,
    plan_room,
    release_refusal,
)
from infinijup.serverext.hibernation import Hibernation, Rest

G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
GB = 10**9


def test_the_least_recently_active_kernel_that_host_memory_can_hold_gives_way():
    idle = [Candidate("old", "old.ipynb", {G0: 40 * GB}),
            Candidate("newer", "newer.ipynb", {G0: 30 * GB})]
    plan = plan_room({G0: 30 * GB}, {G0: 5 * GB}, idle, available=100 * GB, margin=2 * GB)
    assert plan == type(plan)(["old"], None)


def test_a_kernel_too_large_for_host_memory_is_passed_over_for_one_that_fits():
    idle = [Candidate("train", "train.ipynb", {G0: 100 * GB}),
            Candidate("small", "small.ipynb", {G0: 30 * GB})]
    plan = plan_room({G0: 24 * GB}, {G0: 3 * GB}, idle, available=40 * GB, margin=2 * GB)
    assert plan.release == ["small"] and plan.refusal is None


def test_when_nothing_fits_nothing_is_released_and_the_refusal_says_why():
    idle = [Candidate("train", "train.ipynb", {G0: 100 * GB})]
    plan = plan_room({G0: 24 * GB}, {G0: 3 * GB}, idle, available=14 * GB, margin=2 * GB)
    assert plan.release == []
    assert plan.refusal == ("needs 24.0 GB on GPU GPU-00000000, 3.0 GB free; releasing the idle "
                            "kernel 'train.ipynb' needs 100.0 GB of host memory, 14.0 GB free")


def test_kernels_on_other_gpus_never_give_way_and_partial_room_releases_nothing():
    idle = [Candidate("other-gpu", "a.ipynb", {G1: 50 * GB}),
            Candidate("some", "b.ipynb", {G0: 5 * GB})]
    plan = plan_room({G0: 30 * GB}, {G0: 10 * GB}, idle, available=500 * GB, margin=2 * GB)
    assert plan.release == []  # releasing b would not be enough: nobody is disturbed
    assert "needs 30.0 GB on GPU GPU-00000000, 10.0 GB free" in plan.refusal
    assert "no idle kernel holds enough memory there" in plan.refusal


def test_host_memory_is_counted_across_the_releases_of_one_plan():
    idle = [Candidate("a", "a.ipynb", {G0: 30 * GB}), Candidate("b", "b.ipynb", {G0: 30 * GB})]
    # each fits alone, both do not: the second is passed over and the need is not met
    plan = plan_room({G0: 55 * GB}, {G0: 0}, idle, available=50 * GB, margin=2 * GB)
    assert plan.release == [] and "'b.ipynb' needs 30.0 GB of host memory" in plan.refusal


def test_one_release_checks_host_memory_with_a_margin():
    assert release_refusal({G0: 10 * GB}, "x.ipynb", available=20 * GB, margin=2 * GB) is None
    why = release_refusal({G0: 19 * GB}, "x.ipynb", available=20 * GB, margin=2 * GB)
    assert why.startswith("releasing 'x.ipynb' needs 19.0 GB of host memory, 20.0 GB free")
    assert margin_for(128 * GIB) == int(128 * GIB * 0.05) and margin_for(8 * GIB) == 2 * GIB
    available, total = host_memory()
    assert 0 < available <= total


class FakeGpuServer:
    """The manager as the hibernation sees it, with GPUs and host memory of numbers: each
    release moves a kernel's bytes from its GPU into host memory, as the helper's does."""

    make_room_on_wake = True
    log = logging.getLogger("test")

    def __init__(self, free: dict[str, int], held: dict[str, dict[str, int]], host: int):
        self.free, self.held, self.available = free, held, host
        self.released: list[str] = []
        self.last_active = {k: i for i, k in enumerate(held)}  # first: least recently active
        self.lifecycle = Lifecycle()
        self.events = NoEvents()

    def kernel(self, kernel_id):
        return kernel_id

    async def wait_idle(self, km):
        return None

    async def notebook_path(self, kernel_id):
        return f"{kernel_id}.ipynb"

    def idle_kernels(self, now):
        return [(k, 1000.0 - i) for k, i in self.last_active.items()]

    async def gpu_free(self):
        return dict(self.free)

    async def gpu_held(self, kernel_id):
        return dict(self.held.get(kernel_id, {}))

    def host_memory(self):
        return self.available, 128 * GIB

    async def offload_gpu(self, kernel_id):  # the arena's part of a release: none here
        return {}

    async def bring_back_gpu(self, kernel_id, token):
        return {}

    async def release_gpu(self, kernel_id):
        for g, n in self.held.pop(kernel_id).items():
            self.free[g] += n
            self.available -= n
        self.released.append(kernel_id)
        return {}


class NoEvents:
    def end(self, *args, **kwargs):
        return None

    def failed(self, *args, **kwargs):
        return None


async def released(server, kernel_id: str) -> None:
    """``kernel_id`` is released already (its bytes in host memory)."""
    turn = await server.lifecycle.begin(kernel_id, RELEASING)
    turn.to(RELEASED)


def hibernation_of(server, tmp_path) -> Hibernation:
    return Hibernation(server, tmp_path / "records")


def test_a_wake_that_would_need_more_host_memory_than_there_is_releases_nobody(tmp_path):
    # the H200 case of issue 27: K1 (40 GB) released, K3 (100 GB) idle on the GPU, 128 GiB of
    # host memory of which K1's 40 GB are already taken
    server = FakeGpuServer({G0: 10 * GB}, {"k3": {G0: 100 * GB}, "k2": {G0: 8 * GB}},
                           host=50 * GB)
    hib = hibernation_of(server, tmp_path)
    hib.rests["k1"] = Rest(vram={G0: 40 * GB})

    async def wake_k1() -> None:
        await released(server, "k1")
        await hib._make_room("k1", {G0: 40 * GB})

    with pytest.raises(Conflict) as refused:
        asyncio.run(wake_k1())
    assert refused.value.reason == "no_room"
    assert "needs 40.0 GB on GPU GPU-00000000, 10.0 GB free" in refused.value.message
    assert "'k3.ipynb' needs 100.0 GB of host memory, 50.0 GB free" in refused.value.message
    assert server.released == [] and set(server.held) == {"k3", "k2"}  # nobody touched


def test_a_wake_releases_those_that_fit_in_order_and_then_fits(tmp_path):
    server = FakeGpuServer({G0: 10 * GB}, {"k3": {G0: 20 * GB}, "k2": {G0: 15 * GB}},
                           host=100 * GB)
    hib = hibernation_of(server, tmp_path)
    asyncio.run(hib._make_room("k1", {G0: 40 * GB}))
    assert server.released == ["k3", "k2"]
    assert {k: server.lifecycle.state(k) for k in hib.rests} == {"k3": RELEASED,
                                                                  "k2": RELEASED}


def test_the_idle_policy_leaves_a_kernel_whose_memory_host_memory_cannot_hold(tmp_path):
    server = FakeGpuServer({G0: 0}, {"big": {G0: 90 * GB}}, host=60 * GB)
    hib = hibernation_of(server, tmp_path)
    with pytest.raises(Conflict) as refused:
        asyncio.run(hib.release("big"))
    assert refused.value.reason == "no_host_memory"
    assert "'big.ipynb' needs 90.0 GB of host memory, 60.0 GB free" in refused.value.message
    assert server.released == [] and "big" not in hib.rests  # running as it was
    assert server.lifecycle.state("big") == RUNNING


def test_a_kernel_host_memory_cannot_keep_but_can_pass_through_is_hibernated():
    # 30 GB fits while nothing else is released; after "a" (30 GB) is released it would not:
    # "b" is hibernated (first, while host memory has the room), "a" released
    idle = [Candidate("a", "a.ipynb", {G0: 30 * GB}), Candidate("b", "b.ipynb", {G0: 30 * GB})]
    plan = plan_room({G0: 55 * GB}, {G0: 0}, idle, available=50 * GB, margin=2 * GB,
                     can_hibernate=True)
    assert (plan.release, plan.hibernate, plan.refusal) == (["a"], ["b"], None)
    # too large even to pass through: passed over, refused with the reason, nothing moves
    idle = [Candidate("train", "train.ipynb", {G0: 100 * GB})]
    plan = plan_room({G0: 24 * GB}, {G0: 3 * GB}, idle, available=14 * GB, margin=2 * GB,
                     can_hibernate=True)
    assert (plan.release, plan.hibernate) == ([], [])
    assert "releasing or hibernating the idle kernel 'train.ipynb' needs 100.0 GB of host " \
           "memory, 14.0 GB free" in plan.refusal


def test_make_room_hibernates_before_it_releases(tmp_path, monkeypatch):
    server = FakeGpuServer({G0: 0}, {"a": {G0: 30 * GB}, "b": {G0: 30 * GB}}, host=50 * GB)
    server.make_room_hibernate = True
    hib = hibernation_of(server, tmp_path)
    order: list[str] = []

    async def hibernate(kernel_id, *, reason="asked"):  # the store's side is the device's test
        order.append(f"hibernate {kernel_id} ({reason})")
        for g, n in server.held.pop(kernel_id).items():
            server.free[g] += n

    monkeypatch.setattr(hib, "hibernate", hibernate)
    real_release = server.release_gpu

    async def release_gpu(kernel_id):
        order.append(f"release {kernel_id}")
        return await real_release(kernel_id)

    server.release_gpu = release_gpu
    asyncio.run(hib._make_room("k1", {G0: 55 * GB}))
    assert order == ["hibernate b (room for k1.ipynb)", "release a"]


def test_a_running_kernels_allocation_gets_room_from_idle_kernels(tmp_path):
    # the runner (busy: not among the idle) needs 30 GB on a full GPU: the idle kernel gives way
    server = FakeGpuServer({G0: 5 * GB}, {"idle": {G0: 40 * GB}}, host=100 * GB)
    hib = hibernation_of(server, tmp_path)
    asyncio.run(hib.make_room("runner", {G0: 30 * GB}))
    assert server.released == ["idle"]
    assert server.lifecycle.state("idle") == RELEASED
    # with no idle kernel left to give way, the runner is refused with the reason
    with pytest.raises(Conflict) as refused:
        asyncio.run(hib.make_room("runner", {G0: 60 * GB}))
    assert refused.value.reason == "no_room"
    assert "needs 60.0 GB on GPU GPU-00000000" in refused.value.message


def test_two_wakes_racing_for_the_same_room_decide_one_at_a_time(tmp_path):
    # K1 and K2 (30 GB each) are released; K3 (40 GB) idles on a GPU with 10 GB free. Both
    # wake at once: one gets the room K3 leaves; the other finds 20 GB and nobody idle to
    # give way, and is refused with the reason (it stays released). Without one decision at a
    # time both counted K3's bytes and the second reacquire failed in the driver.
    server = FakeGpuServer({G0: 10 * GB}, {"k3": {G0: 40 * GB}}, host=100 * GB)
    reacquired: list[str] = []

    async def reacquire_gpu(kernel_id):
        need = hib.rests[kernel_id].vram[G0]
        await asyncio.sleep(0)  # the driver takes its time: others run meanwhile
        assert server.free[G0] >= need, f"{kernel_id}: the driver found no room"
        server.free[G0] -= need
        reacquired.append(kernel_id)
        return {}

    server.reacquire_gpu = reacquire_gpu
    hib = hibernation_of(server, tmp_path)

    async def both() -> list:
        for k in ("k1", "k2"):
            hib.rests[k] = Rest(vram={G0: 30 * GB})
            await released(server, k)
        return await asyncio.gather(hib.wake_soon("k1"), hib.wake_soon("k2"),
                                    return_exceptions=True)

    results = asyncio.run(both())
    assert server.released == ["k3"] and len(reacquired) == 1
    refused = [r for r in results if isinstance(r, Conflict)]
    assert len(refused) == 1 and refused[0].reason == "no_room", results
    loser = "k2" if reacquired == ["k1"] else "k1"
    assert server.lifecycle.state(loser) == RELEASED  # still resting, resumable
    assert server.lifecycle.state(reacquired[0]) == RUNNING
