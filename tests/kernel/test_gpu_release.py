"""The quiesce steps that give back what GPU libraries cache but do not use (gpu_sync.py) and
the CUDA contexts' stack memory (gpu_context.py).

Without torch nothing happens and nothing is reported. The logic is tested here on a small
stand-in for torch put into ``sys.modules`` (a unit test of the release function, for machines
without a GPU): only devices holding a context are touched, the work is synchronized before the
cache is emptied, live memory stays, and the numbers reach the commit's metadata through the
agent. On a GPU machine, the last two tests do it for real through the server: a model cast
from fp32 to bf16 leaves its fp32 copy cached; the snapshot releases it, keeps the tensor (same
address, same bytes) and records the release; the restore brings the tensor back.
"""

from __future__ import annotations

import os
import shutil
import sys
import types

import pytest
from kernelkit import needs_helper

from infinijup.kernel_magics import agent, gpu_sync, hooks

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None


class FakeCuda:
    """Two devices; PyTorch has a context on device 0 only. Reserved = live + cached."""

    def __init__(self, initialized: bool = True) -> None:
        self.initialized = initialized
        self.live = {0: 9_300, 1: 0}
        self.cached = {0: 9_200, 1: 0}
        self.calls: list[tuple] = []
        self.tensor = bytearray(b"weights")  # a live tensor's bytes: never touched

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return 2

    def synchronize(self, dev: int) -> None:
        self.calls.append(("synchronize", dev))

    def memory_reserved(self, dev: int) -> int:
        self.calls.append(("reserved", dev))
        return self.live[dev] + self.cached[dev]

    def memory_allocated(self, dev: int) -> int:
        return self.live[dev]

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))
        self.cached = {dev: 0 for dev in self.cached}


def fake_torch(cuda: FakeCuda) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = cuda
    torch._C = types.SimpleNamespace(_cuda_hasPrimaryContext=lambda dev: dev == 0)
    return torch


@pytest.fixture
def no_gpu_libraries(monkeypatch):
    for name in ("torch", "cupy", "jax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv(gpu_sync.KEEP_CACHE_ENV, raising=False)


def _maps_libcuda() -> bool:
    with open("/proc/self/maps") as f:
        return "libcuda.so" in f.read()


def test_without_torch_nothing_happens(no_gpu_libraries):
    before, had_libcuda = set(sys.modules), _maps_libcuda()
    assert gpu_sync.release_cached_memory() == {}
    info = hooks.run_quiesce()
    assert "gpu_release" not in info
    assert set(sys.modules) == before  # nothing imported (no torch, no CUDA)
    assert _maps_libcuda() == had_libcuda  # the contexts' trim (gpu_context.py) loads no driver
    assert hooks.run_resume(False)["hook_errors"] == []


def test_release_frees_the_cache_of_devices_in_use(no_gpu_libraries, monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    report = gpu_sync.release_cached_memory()
    assert report == {"torch": {"reserved_before": 18_500, "reserved_after": 9_300,
                                "allocated": 9_300},
                      "reserved_before": 18_500, "reserved_after": 9_300, "allocated": 9_300}
    # device 1 (no context) was never touched; the work finished before the cache went
    assert all(call[1:] in ((), (0,)) for call in cuda.calls), cuda.calls
    assert cuda.calls.index(("synchronize", 0)) < cuda.calls.index(("empty_cache",))
    assert cuda.live == {0: 9_300, 1: 0} and cuda.tensor == bytearray(b"weights")


def test_no_cuda_context_no_release(no_gpu_libraries, monkeypatch):
    cuda = FakeCuda(initialized=False)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    assert gpu_sync.release_cached_memory() == {}
    assert cuda.calls == []  # not even a query: it could initialize CUDA


def test_release_can_be_switched_off(no_gpu_libraries, monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    monkeypatch.setenv(gpu_sync.KEEP_CACHE_ENV, "1")
    assert gpu_sync.release_cached_memory() == {}
    assert cuda.cached[0] == 9_200


def test_a_failing_library_is_reported_not_raised(no_gpu_libraries, monkeypatch):
    cuda = FakeCuda()

    def broken() -> None:
        raise RuntimeError("CUDA error: out of memory")

    cuda.empty_cache = broken
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    report = gpu_sync.release_cached_memory()
    assert report["torch"] == {"error": "RuntimeError: CUDA error: out of memory"}
    assert report["reserved_before"] == 0


def test_the_release_runs_after_the_hooks_and_reaches_the_commit(no_gpu_libraries, monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))

    def free_a_buffer() -> None:  # a library's hook drops a tensor it no longer needs
        cuda.live[0] -= 300
        cuda.cached[0] += 300

    hooks.register_quiesce_hook(free_a_buffer)
    try:
        info = hooks.run_quiesce()
    finally:
        hooks.unregister_hook(free_a_buffer)
    assert info["gpu_release"]["allocated"] == 9_000
    assert info["gpu_release"]["reserved_after"] == 9_000
    meta = agent.commit_metadata({**info, "cell": {"execution_count": 3, "source": "x"}})
    assert meta["gpu_release"] == info["gpu_release"]


def test_commit_metadata_keeps_only_byte_counts():
    meta = agent.commit_metadata({"gpu_release": {
        "reserved_before": 10, "reserved_after": -1, "allocated": "many",
        "torch": {"reserved_before": 10, "evil": "x" * 10_000, "error": "e" * 500},
        "other": {"reserved_before": 1}}})
    assert meta == {"gpu_release": {"reserved_before": 10,
                                    "torch": {"reserved_before": 10, "error": "e" * 200}}}
    assert agent.commit_metadata({"gpu_release": "lots"}) == {}


# --- for real, on a GPU machine ---------------------------------------------------------------
CAST = """
import torch
torch.manual_seed(0)
w = torch.randn(512 * 2**20, device="cuda")     # 2 GiB of fp32
w16 = w.to(torch.bfloat16); del w                # 1 GiB live; the fp32 block stays cached
torch.cuda.synchronize()
reserved, live = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
ptr, chk = w16.data_ptr(), float(w16[::4096].float().sum())
"""
GiB = 1 << 30


@needs_helper
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)")
@pytest.mark.parametrize("how", ["rest", "magic"])
@pytest.mark.parametrize("allocator", ["vmm", "driver"])
async def test_a_snapshot_leaves_the_cache_out_and_keeps_the_tensors(notebook, how, allocator,
                                                                     monkeypatch):
    """The 1 GiB cast of a 2 GiB fp32 tensor: the fp32 block stays cached, dead. Infinijup's
    VMM allocator (the default) copies only what PyTorch has in use; on the driver path
    (INFINIJUP_GPU_ALLOCATOR=driver, or where the allocator is not in place) the quiesce's
    empty_cache gives the cache back before the driver saves the rest."""
    if allocator == "driver":
        monkeypatch.setenv("INFINIJUP_GPU_ALLOCATOR", "driver")
        await notebook.restart()  # the setting is read when a kernel starts
    nb = notebook
    await nb.execute(CAST)
    reserved, live = await nb.value("(reserved, live)")
    assert reserved - live >= 2 * GiB - (64 << 20), (reserved, live)  # the cached fp32 block
    if how == "rest":
        snap = await nb.snapshot(message="released")
        commit, release = snap["commit"], snap["stats"]["gpu_release"]
    else:
        out = await nb.execute("%snapshot -w -m released")
        assert out["stdout"].startswith("Snapshot "), out
        latest = (await nb.history())["commits"][0]
        commit, release = latest["id"], latest["metadata"]["gpu_release"]
    assert release["reserved_before"] >= reserved and release["allocated"] == live, release
    meta = next(c for c in (await nb.history())["commits"] if c["id"] == commit)["metadata"]
    saved = sum(meta["gpu"]["vram_bytes"].values())
    if allocator == "vmm":
        segments = meta["gpu_segments"]
        assert segments["segment_bytes"] >= reserved - (64 << 20), segments  # all of it moved
        assert segments["bytes"] <= live + (64 << 20), segments  # but only the live bytes kept
        assert saved < GiB, saved  # the driver saw the CUDA context only
    else:
        assert "gpu_segments" not in meta, meta
        assert release["reserved_after"] <= release["reserved_before"] - 2 * GiB + (64 << 20)
        # (before any cell allocates again) the cache is what the release left
        assert await nb.value("torch.cuda.memory_reserved()") == release["reserved_after"]
        assert saved < release["reserved_before"], (saved, release)  # not the cache
    # the live tensor did not move and did not change
    assert await nb.value("(w16.data_ptr() == ptr, float(w16[::4096].float().sum()) == chk)") \
        == (True, True)
    assert meta["gpu_release"] == release
    await nb.execute("w16.zero_(); torch.cuda.synchronize()")
    await nb.restore(commit)
    assert await nb.value("(w16.data_ptr() == ptr, float(w16[::4096].float().sum()) == chk)") \
        == (True, True)



DEEP = """
import ctypes, torch
deep = torch.cuda.jiterator._create_jit_fn(
    "template <typename T> T deep(T x) { volatile T a[1024]; "
    "for (int i = 0; i < 1024; i++) a[i] = x * i; return a[((int)x) & 1023]; }")
xd = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
def deep_ok():
    return bool(torch.equal(deep(xd), xd * (xd.int() & 1023).float()))
_cu = ctypes.CDLL("libcuda.so.1")
def stack():
    torch.cuda.synchronize()
    v = ctypes.c_size_t()
    assert _cu.cuCtxGetLimit(ctypes.byref(v), 0) == 0  # CU_LIMIT_STACK_SIZE
    return v.value
"""


@needs_helper
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)")
async def test_a_snapshot_leaves_the_contexts_stack_memory_out(notebook):
    """A kernel needing 4 KiB of stack per thread makes the driver keep that for every thread
    the card can run (1 GiB on an H100 or H200). The quiesce frees it before the driver's
    checkpoint; the kernel finds its stack size as it was after the snapshot and the restore."""
    nb = notebook
    await nb.execute(DEEP, timeout=120)
    assert await nb.value("deep_ok()")
    grown = await nb.value("stack()")
    assert grown >= 4096, grown  # the driver grew it at the launch
    snap = await nb.snapshot(message="deep stack")
    freed = snap["stats"]["gpu_release"]["local_memory"]
    assert freed >= 256 * 2**20, snap["stats"]
    meta = (await nb.history())["commits"][0]["metadata"]
    assert meta["gpu_release"]["local_memory"] == freed
    assert await nb.value("stack()") == grown  # set back by the resume
    assert await nb.value("deep_ok()")
    await nb.execute("xd.zero_(); torch.cuda.synchronize()")
    await nb.restore(snap["commit"])
    assert await nb.value("stack()") == grown
    assert await nb.value("(float(xd[7]), deep_ok())") == (7.0, True)
