"""A kernel holding a live NCCL communicator, or GPU memory shared with another process
through CUDA IPC, is refused before anything is frozen (issue 33).

Through the real server, helper and kernel: the snapshot (REST and ``%snapshot``) answers
422 (``live_nccl``, ``cuda_ipc``) with what to do, no commit is made and the kernel runs on as
it was; once the group is destroyed or the shared tensors are gone, the same kernel snapshots.
The communicator and PyTorch's sharing cache are stand-ins here (modules answering as
``torch.distributed`` on NCCL and ``torch.multiprocessing.reductions`` holding a received CUDA
storage do: this machine has no GPU and no torch); the real ones run on the GPU machine
(tests/kernel/test_gpu_multi.py). A multiprocessing semaphore that CRIU cannot save is real
here: the snapshot fails with ``posix_semaphore`` saying what to do.
"""

from __future__ import annotations

import json

from kernelkit import needs_helper

pytestmark = needs_helper

LIVE_GROUP = """
import sys, types
dist = types.ModuleType("torch.distributed")
group = {"live": True}
dist.is_available = lambda: True
dist.is_initialized = lambda: group["live"]
dist.get_backend = lambda group=None: "nccl"
sys.modules["torch.distributed"] = dist
weights = list(range(1000))
"""


async def refused(nb, reason: str) -> str:  # noqa: ANN001
    """A snapshot of the kernel answers 422 ``reason``; no commit is made and the kernel runs
    on (its ``weights`` intact). Returns the message."""
    r = await nb.post("snapshot", {"kernel_id": nb.kernel_id})
    body = json.loads(r.body)
    assert (r.code, body.get("reason")) == (422, reason), r.body
    assert (await nb.history())["commits"] == []
    assert await nb.value("sum(weights)") == sum(range(1000))
    return body["message"]


async def test_a_live_nccl_group_is_refused_and_the_kernel_runs_on(notebook):
    nb = notebook
    await nb.execute(LIVE_GROUP)
    assert "destroy_process_group" in await refused(nb, "live_nccl")

    out = await nb.collect(nb.send_execute("%snapshot -m with-group\nafter = True"))
    assert out["reply"]["status"] == "error", out
    assert out["reply"]["traceback"][-1].endswith("(live_nccl)"), out
    assert (await nb.history())["commits"] == []

    await nb.execute("group['live'] = False")  # destroy_process_group()
    snap = await nb.snapshot(message="after the group")
    assert [c["id"] for c in (await nb.history())["commits"]] == [snap["commit"]]
    await nb.execute("weights.append(1)")
    await nb.restore(snap["commit"])
    assert await nb.value("len(weights)") == 1000


SHARED_CUDA_STORAGE = """
import sys, types

class Storage:
    def __init__(self, device):
        self.device = types.SimpleNamespace(type=device)

class Ref:  # as torch.multiprocessing's StorageWeakRef: cdata, expired()
    def __init__(self, storage):
        self.cdata, self.storage = id(storage), storage
    def expired(self):
        return self.storage is None

live = {}
torch = types.ModuleType("torch")
torch.UntypedStorage = types.SimpleNamespace(_new_with_weak_ptr=lambda cdata: live.get(cdata))
reductions = types.ModuleType("torch.multiprocessing.reductions")
cpu, cuda = Storage("cpu"), Storage("cuda")
live.update({id(cpu): cpu, id(cuda): cuda})
reductions.shared_cache = {"fd": Ref(cpu), b"cuda-ipc-handle": Ref(cuda)}
sys.modules.update({"torch": torch, "torch.multiprocessing.reductions": reductions})
weights = list(range(1000))
"""


async def test_gpu_memory_shared_with_another_process_is_refused(notebook):
    nb = notebook
    await nb.execute(SHARED_CUDA_STORAGE)
    assert "1 CUDA storage sent or received" in await refused(nb, "cuda_ipc")

    # the received tensor deleted: its weak reference expires (a CPU storage shared the
    # same way stays, and stops nothing)
    await nb.execute("reductions.shared_cache[b'cuda-ipc-handle'].storage = None")
    snap = await nb.snapshot(message="nothing shared on the GPU")
    assert [c["id"] for c in (await nb.history())["commits"]] == [snap["commit"]]


async def test_a_multiprocessing_semaphore_of_spawn_is_named_one_of_fork_is_saved(notebook):
    """A multiprocessing Queue made with the spawn (or forkserver) start method keeps its POSIX
    semaphore's file linked in /dev/shm under another name than the one mapped, which CRIU
    cannot save: the snapshot fails saying which object and what to do, and the kernel runs
    on. One made with fork is unlinked at once: CRIU saves its content, and it comes back."""
    nb = notebook
    await nb.execute("import gc, multiprocessing as mp\nq = mp.get_context('spawn').Queue()\n"
                     "weights = list(range(1000))")
    assert "get_context('fork')" in await refused(nb, "posix_semaphore")

    await nb.execute("q.close(); del q; gc.collect()\n"
                     "q = mp.get_context('fork').Queue(); q.put('kept')")
    snap = await nb.snapshot(message="a queue of fork")
    assert await nb.value("q.get(timeout=60)") == "kept"
    await nb.restore(snap["commit"])
    assert await nb.value("q.get(timeout=60)") == "kept"
