"""GPU state through the real Jupyter server path: CUDA tensors, RNG, a transformer's greedy
decoding, a CUDA graph and a Triton kernel survive snapshot and restore; two GPU branches from one
snapshot. Runs on an NVIDIA GPU machine (H100/H200); skipped with the reason elsewhere."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
from kernelkit import needs_helper

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None

pytestmark = [
    needs_helper,
    pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)"),
    pytest.mark.timeout(600),
]

TENSORS = """
import hashlib, torch
torch.manual_seed(0)
g = torch.Generator(device="cuda").manual_seed(1234)
t = torch.randn(4096, 4096, device="cuda", generator=g)
ballast = torch.randn(256 * 2**20, device="cuda")  # 1 GiB of VRAM
def digest(x):
    return hashlib.sha256(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
"""

TRANSFORMER = """
import torch, torch.nn as nn
torch.manual_seed(7)
class TinyLM(nn.Module):
    def __init__(self, vocab=1000, d=256, layers=4, heads=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(512, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)
    def forward(self, ids):
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        x = self.emb(ids) + self.pos(torch.arange(n, device=ids.device))
        return self.head(self.body(x, mask=mask, is_causal=True))
model = TinyLM().cuda().eval()
prompt = torch.randint(0, 1000, (1, 16), device="cuda")
@torch.no_grad()
def greedy(ids, steps=32):
    for _ in range(steps):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids[0].tolist()
"""

GRAPH_AND_TRITON = """
import torch, triton, triton.language as tl
@triton.jit
def axpy(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, a * tl.load(x_ptr + i, mask=m) + tl.load(y_ptr + i, mask=m), mask=m)
def run_axpy(a, x, y):
    out = torch.empty_like(x)
    axpy[(triton.cdiv(x.numel(), 1024),)](x, y, out, a, x.numel(), BLOCK=1024)
    return out
xs = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
ys = torch.ones_like(xs)
triton_before = run_axpy(3.0, xs, ys).sum().item()
static_in = torch.zeros(1 << 20, device="cuda")
static_out = torch.zeros_like(static_in)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    static_out.copy_(static_in * 2 + 1)
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_out.copy_(static_in * 2 + 1)
"""


async def test_tensors_and_cuda_rng_survive(notebook):
    nb = notebook
    await nb.execute(TENSORS, timeout=120)
    d_t = await nb.value("digest(t)")
    snap = await nb.snapshot(message="gpu tensors")
    # PyTorch's memory left the GPU through Infinijup's VMM allocator, into the kernel's arena
    # file, stored beside the images: the driver's checkpoint had only the CUDA context left
    segments = snap["stats"].get("gpu_segments", {})
    assert segments.get("bytes", 0) > 2**30, snap["stats"]
    hist = await nb.history()
    meta = hist["commits"][0]["metadata"]
    print("VMM-STATS", snap["stats"], meta["gpu"]["vram_bytes"], meta.get("gpu_segments"))
    assert meta["gpu_segments"]["bytes"] == segments["bytes"]
    assert sum(meta["gpu"]["vram_bytes"].values()) < 2**30, meta["gpu"]
    assert meta["gpu"]["fingerprint"]["gpus"][0]["name"].startswith("NVIDIA")
    # The draws right after the snapshot, in the original run.
    draws = await nb.value("(torch.randn(8, device='cuda', generator=g).tolist(), torch.rand(4, device='cuda').tolist())")
    await nb.execute("t.mul_(0); ballast.zero_()")
    await nb.restore(snap["commit"])
    assert await nb.value("digest(t)") == d_t
    assert await nb.value("(torch.randn(8, device='cuda', generator=g).tolist(), torch.rand(4, device='cuda').tolist())") == draws
    assert await nb.value("float(ballast.abs().sum()) > 0")


async def _phase(nb) -> str | None:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    op = json.loads(r.body).get("operation")
    return op["phase"] if op else None


async def test_a_cell_sent_during_a_snapshot_finds_its_gpu_memory(notebook):
    """The kernel runs again after its dump, before the server's resume call: a cell the user
    sent meanwhile (queued while the kernel was held) must find its tensors on the GPU."""
    nb = notebook
    await nb.execute(TENSORS, timeout=120)
    d_t = await nb.value("digest(t)")
    post = asyncio.ensure_future(nb.post("snapshot", {"kernel_id": nb.kernel_id}))
    while await _phase(nb) in (None, "queued", "quiesce"):  # until the quiesce has returned
        assert not post.done(), (await post).body
        await asyncio.sleep(0.01)
    cell = nb.send_execute("during = digest(t); ok = float((t @ t).trace()) == float((t @ t).trace())")
    r = await post
    assert r.code == 201, r.body
    assert json.loads(r.body)["stats"]["gpu_segments"]["bytes"] > 2**30
    out = await nb.collect(cell)
    assert out["reply"]["status"] == "ok", out
    assert await nb.value("during") == d_t and await nb.value("ok") is True
    # The cell may have started before the process was frozen (it is then in the image,
    # waiting for the dump to be over): a restore of this snapshot after a second one has
    # rewritten the kernel's arena still brings back this snapshot's memory.
    first = json.loads(r.body)["commit"]
    await nb.execute("t.add_(1)")
    await nb.snapshot(message="second")
    await nb.restore(first)
    assert await nb.value("digest(t)") == d_t


def _stored_segments(jp_serverapp, commit_id: str) -> bytes:
    repo = jp_serverapp.web_app.settings["infinijup_manager"].repo()
    tree = repo.get_tree(repo.get_commit(commit_id).tree)
    return repo.read_blob(next(e.id for e in tree if e.name == "gpu-segments"))


async def test_a_second_snapshot_stores_only_the_changed_gpu_memory(notebook, jp_serverapp):
    from infinijup.gpu import arena

    nb = notebook
    await nb.execute(TENSORS, timeout=120)
    d_first = await nb.value("digest(t)")
    d_ballast = await nb.value("digest(ballast)")
    first = await nb.snapshot(message="first")
    await nb.execute("t.add_(1)")  # 64 MiB of the 1.1 GiB changed
    d_t = await nb.value("digest(t)")
    second = await nb.snapshot(message="second")
    print("INCREMENTAL", first["stats"], second["stats"])
    # the GPU-side hashes: only the changed blocks were copied out of the GPU...
    live = first["stats"]["gpu_segments"]["bytes"]
    copied = second["stats"]["gpu_segments"]["bytes"]
    assert 64 * 2**20 <= copied < 0.2 * live, (first["stats"], second["stats"])
    # ...stored, and read: the store read the arena file where the kernel said it changed
    assert second["stats"]["stored_bytes"] < 0.2 * live, second["stats"]
    # (read_bytes counts the CRIU images too, read whole each time)
    assert first["stats"]["read_bytes"] == first["stats"]["image_bytes"], first["stats"]
    unread = second["stats"]["image_bytes"] - second["stats"]["read_bytes"]
    assert unread > 0.8 * live, second["stats"]
    # what the store holds is the file byte for byte (read before the next snapshot
    # rewrites it), whatever the restore below takes its images from
    with open(arena.segments_path(nb.kernel_id), "rb") as f:
        assert _stored_segments(jp_serverapp, second["commit"]) == f.read()
    await nb.execute("t.zero_(); ballast.zero_()")
    await nb.restore(second["commit"])
    assert await nb.value("digest(t)") == d_t
    assert await nb.value("digest(ballast)") == d_ballast  # in the file, not copied again
    # After a restore of the first snapshot the kernel's arena file still holds the second's
    # bytes, and the restored process remembers the first's hashes: they must not be trusted.
    await nb.restore(first["commit"])
    assert await nb.value("digest(t)") == d_first
    third = await nb.snapshot(message="third, unchanged since the restore")
    assert third["stats"]["gpu_segments"]["bytes"] >= 0.9 * live, third["stats"]
    assert third["stats"]["read_bytes"] == third["stats"]["image_bytes"], third["stats"]
    await nb.execute("t.zero_()")
    await nb.restore(third["commit"])
    assert await nb.value("digest(t)") == d_first


async def test_transformer_greedy_decoding_continues_identically(notebook):
    nb = notebook
    await nb.execute(TRANSFORMER, timeout=120)
    await nb.execute("first = greedy(prompt, 8)")
    snap = await nb.snapshot(message="mid-generation")
    reference = await nb.value("greedy(torch.tensor([first], device='cuda'))")
    await nb.execute("model.head.weight.data.normal_()")  # wreck the model
    await nb.restore(snap["commit"])
    assert await nb.value("greedy(torch.tensor([first], device='cuda'))") == reference


async def test_cuda_graph_and_triton_kernel_run_after_restore(notebook):
    nb = notebook
    await nb.execute(GRAPH_AND_TRITON, timeout=180)
    assert await nb.value("bool((static_out == 1.0).all())")  # the warm-up's result
    snap = await nb.snapshot(message="graph + triton")
    # Change what the snapshot holds: the graph's buffers (replayed on new input), the Triton
    # kernel's inputs, and both objects gone.
    await nb.execute("static_in.fill_(5.0); graph.replay(); xs.zero_(); ys.zero_(); "
                     "torch.cuda.synchronize(); del graph, axpy")
    assert await nb.value("bool((static_out == 11.0).all()) and float(xs.abs().sum()) == 0")
    await nb.restore(snap["commit"])
    # back as snapshotted: buffers, inputs, the graph and the compiled kernel
    assert await nb.value("bool((static_in == 0).all()) and bool((static_out == 1.0).all())")
    assert await nb.value("run_axpy(3.0, xs, ys).sum().item() == triton_before")
    await nb.execute("static_in.fill_(5.0); graph.replay(); torch.cuda.synchronize()")
    assert await nb.value("bool((static_out == 11.0).all())")


async def test_two_gpu_branches_from_one_snapshot(notebook):
    nb = notebook
    await nb.execute("import torch; base = torch.arange(1 << 24, device='cuda', dtype=torch.float64)")
    a = (await nb.snapshot(message="A"))["commit"]
    await nb.execute("base += 1")
    b = await nb.snapshot(message="B: +1")
    await nb.restore(a)
    # A's GPU memory, not what the kernel's arena holds now (B's)
    assert await nb.value("float(base[10])") == 10.0
    await nb.execute("base *= 3")
    c = await nb.snapshot(message="C: *3")
    assert c["thread"] != b["thread"]
    await nb.restore(b["commit"])
    assert await nb.value("float(base[10])") == 11.0
    await nb.restore(c["commit"])
    assert await nb.value("float(base[10])") == 30.0


async def test_gpu_release_and_reacquire_in_place(notebook, jp_serverapp, helper_daemon):
    from infinijup.gpu.preflight import read_nvml
    from infinijup.helper_client import HelperClient

    nb = notebook
    await nb.execute("import torch, hashlib; v = torch.randn(64 * 2**20, device='cuda'); "
                     "d = hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest()")
    root = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
    helper = HelperClient(helper_daemon.socket_path)
    from infinijup_helper.cuda_stage import tree_pids

    pids = set(tree_pids(root))
    before = sum(read_nvml().usage_by_gpu(pids).values())
    released = helper.gpu(root, "release")
    assert released["gpu"]["pids"] == 1
    after = sum(read_nvml().usage_by_gpu(pids).values())
    assert before > 256 * 2**20 and after == 0, (before, after)
    helper.gpu(root, "reacquire")
    assert await nb.value("hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest() == d")
    # the same through the engine (SnapshotEngine.release_gpu / reacquire_gpu)
    engine = jp_serverapp.web_app.settings["infinijup_manager"].engine()
    assert engine.release_gpu(root)["gpu"]["pids"] == 1
    assert sum(read_nvml().usage_by_gpu(pids).values()) == 0
    engine.reacquire_gpu(root)
    assert sum(read_nvml().usage_by_gpu(pids).values()) > 256 * 2**20  # back on the GPU
    assert await nb.value("hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest() == d")
    assert await nb.value("float((v * 2).sum()) == float(v.sum()) * 2")  # the GPU computes


def _gpu_count() -> int:
    if not HAS_GPU:
        return 0
    import subprocess

    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two GPUs of one model")
async def test_restore_onto_another_gpu(notebook, jp_serverapp):
    from infinijup.gpu.preflight import read_nvml
    from infinijup_helper.cuda_stage import tree_pids

    nb = notebook
    await nb.execute("import torch, hashlib; w = torch.randn(32 * 2**20, device='cuda:0'); "
                     "d = hashlib.sha256(w.cpu().numpy().tobytes()).hexdigest()")
    snap = await nb.snapshot(message="on GPU 0")
    report = read_nvml()
    first, second = report.fingerprint.gpus[0].uuid, report.fingerprint.gpus[1].uuid
    root = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
    before = read_nvml().usage_by_gpu(set(tree_pids(root)))
    await nb.restore(snap["commit"], gpu_map={first: second})
    root = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
    usage = read_nvml().usage_by_gpu(set(tree_pids(root)))
    # The kernel's memory on GPU 0 (context + 128 MiB tensor) is now on GPU 1.
    assert usage.get(second, 0) >= before.get(first, 0) > 128 * 2**20, (before, usage)
    assert usage.get(first, 0) == before.get(second, 0), (before, usage)
    assert await nb.value("hashlib.sha256(w.cpu().numpy().tobytes()).hexdigest() == d")
    assert await nb.value("float((w * 2).sum()) == float(w.sum()) * 2")
