"""GPU snapshot and restore, phase by phase, against the driver's own floor.

Two kinds of rows, each measured in one run beside its floors:

* ``--sizes N ...``: kernels holding N GB of VRAM (random data), through the engine: the
  driver's lock+checkpoint and restore+unlock alone on the same process, a raw `criu dump` of
  the checkpointed process to tmpfs (the floor of a snapshot's pause), then Infinijup's snapshot
  (helper: CUDA checkpoint, CRIU dump, CUDA resume; store ingest) and restore (store checkout,
  kill + CRIU restore, CUDA restore, first execute answered).
* ``--llama 1b 4.6b``: a notebook as people hold one, through a real Jupyter server and the
  REST API: a Llama-shaped model (transformers' LlamaForCausalLM, random weights, initialised
  in fp32 on the GPU then cast to bf16, 1.1 B or 4.6 B parameters) with the KV cache of a
  sampled generate. VRAM reserved and live, image bytes, the pause, the time until the next
  cell runs (sent as the dump starts), the durable commit, ``%snapshot``'s cell, restore to the
  first answer from the hot tier and from the store (hot copy removed, page cache dropped),
  each phase; floors: the driver's checkpoint of the same process, a raw CRIU dump to tmpfs,
  pinned copy bandwidth. Sampling after each restore must draw what it drew after the
  snapshot. ``--work disk tmpfs hugetmpfs`` runs each row with the helper's work dir (dumps,
  hot tier) on disk, on /dev/shm and on a tmpfs with huge pages. ``--arena helper shm``: the
  kernels' GPU arena in the helper's tmpfs with huge pages (the default) or in /dev/shm.

Prints JSON lines, then markdown tables. Run as root on the GPU machine, with the helper's
requirements (CRIU, pycriu) in place:
    python bench/gpu_bench.py --sizes 1 4 16
    python bench/gpu_bench.py --llama 1b --work disk tmpfs       # about 5 minutes on an H100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchkit import (
    CRIU,
    GB,
    drop_page_cache,
    execute,
    first_answer,
    huge_tmpfs,
    kernel_root,
    make_base,
    markdown_table,
    read_packs,
    start_helper,
    start_server,
    transposed_table,
    tree_rss,
    use_infinijup_kernelspec,
)
from jupyter_client import KernelManager

from infinijup.engine import SnapshotEngine
from infinijup.gpu import vmm
from infinijup.helper_client import HelperClient
from infinijup.store import Repository
from infinijup_helper import cuda_driver as driver
from infinijup_helper.cuda_stage import cuda_pids

SEGMENT_PARTS = ("hash_s", *vmm.TIMING_KEYS)
PARTS_LABEL = " / ".join(k[: -len("_s")] for k in SEGMENT_PARTS)  # "hash / wait / ..."


def segment_parts(segments: dict) -> str | None:
    """The way out of the VMM segments, part by part (kernel_magics/gpu_vmm.py's report)."""
    if not any(k in segments for k in SEGMENT_PARTS):
        return None
    return " / ".join(f"{segments.get(k, 0):.2f}" for k in SEGMENT_PARTS)


def one_size(size_gb: float, store_dir: Path, shm: Path) -> dict:
    km = KernelManager(kernel_name="infinijup")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    row: dict = {"vram_gb": size_gb}
    try:
        n = int(size_gb * GB / 4)
        execute(kc, f"import torch; x = torch.rand({n}, device='cuda'); torch.cuda.synchronize(); "
                    "chk = float(x[::4096].double().sum())")
        root = km.provisioner.root_pid
        pids = cuda_pids(root)
        # Floor 1: the driver alone, on the same process.
        t0 = time.perf_counter()
        for p in pids:
            driver.suspend(p, 60_000)
        row["driver_checkpoint_s"] = time.perf_counter() - t0
        # Floor 2: a raw CRIU dump of the checkpointed process to tmpfs.
        raw = shm / "raw"
        raw.mkdir()
        t0 = time.perf_counter()
        subprocess.run([CRIU, "dump", "-t", str(root), "-D", str(raw), "--leave-running",
                        "--tcp-established", "--network-lock", "skip", "--file-locks",
                        "-o", "dump.log"], check=True, capture_output=True)
        row["raw_dump_s"] = time.perf_counter() - t0
        shutil.rmtree(raw)
        t0 = time.perf_counter()
        for p in pids:
            driver.resume(p)
        row["driver_restore_s"] = time.perf_counter() - t0
        first_answer(kc)

        repo = Repository.open_or_init(store_dir)
        engine = SnapshotEngine(repo, HelperClient())
        t0 = time.perf_counter()
        res = engine.snapshot(root, thread="bench", message=f"{size_gb} GB", metadata={},
                              parents=[], expected_tip=None)
        row["snapshot_total_s"] = time.perf_counter() - t0
        timings = res.commit.metadata["timings"]
        gpu = res.commit.metadata.get("gpu") or {}
        row["pause_s"] = res.pause_s
        row["lock_checkpoint_s"] = timings.get("helper_cuda_checkpoint_s", 0.0)
        row["criu_dump_s"] = timings.get("helper_dump_s", 0.0)
        row["cuda_resume_s"] = timings.get("helper_cuda_resume_s", 0.0)
        row["store_ingest_s"] = res.phases["store_s"]
        row["image_gb"] = res.image_bytes / GB
        row["stored_gb"] = res.stored_bytes / GB
        row["vram_saved_gb"] = sum((gpu.get("vram_bytes") or {}).values()) / GB
        answer_after_snapshot = first_answer(kc)
        row["answer_after_snapshot_s"] = answer_after_snapshot

        t0 = time.perf_counter()
        images = engine.materialize(res.commit.id)
        row["store_checkout_s"] = time.perf_counter() - t0
        km.provisioner.restoring = True
        t1 = time.perf_counter()
        rres = engine.restore(images, root)
        km.provisioner.attach(rres.pid)
        row["criu_restore_s"] = rres.phases.get("restore", 0.0)
        row["cuda_restore_s"] = rres.phases.get("cuda_restore", 0.0)
        kc.stop_channels()
        kc = km.client()
        kc.start_channels()
        row["first_execute_s"] = first_answer(kc)
        row["restore_to_answer_s"] = time.perf_counter() - t1
        row["restore_total_s"] = time.perf_counter() - t0
        execute(kc, "assert float(x[::4096].double().sum()) == chk")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return row


COLUMNS = [
    ("vram_gb", "VRAM GB"), ("driver_checkpoint_s", "driver ckpt s"),
    ("raw_dump_s", "raw dump s"), ("driver_restore_s", "driver restore s"),
    ("lock_checkpoint_s", "lock+ckpt s"), ("criu_dump_s", "CRIU dump s"),
    ("cuda_resume_s", "CUDA resume s"), ("pause_s", "pause s"),
    ("pause_ratio", "pause / (driver ckpt + raw dump + driver restore)"),
    ("store_ingest_s", "ingest s"), ("image_gb", "image GB"), ("stored_gb", "stored GB"),
    ("store_checkout_s", "checkout s"), ("criu_restore_s", "CRIU restore s"),
    ("cuda_restore_s", "CUDA restore s"), ("first_execute_s", "first execute s"),
    ("restore_to_answer_s", "restore to answer s"), ("restore_total_s", "restore incl. checkout s"),
]


# --- a Llama-shaped notebook, through the server ---------------------------------------------
MODELS = {  # LlamaConfig shapes: 1.1 B (TinyLlama's) and 4.6 B parameters
    "1b": {"hidden": 2048, "intermediate": 5632, "layers": 22, "heads": 32, "kv_heads": 4},
    "4.6b": {"hidden": 3072, "intermediate": 8192, "layers": 44, "heads": 24, "kv_heads": 8},
}
BATCH, PROMPT, NEW_TOKENS = 4, 512, 32

BUILD = """
import time, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
_t = time.perf_counter()
cfg = LlamaConfig(vocab_size=32000, hidden_size={hidden}, intermediate_size={intermediate},
                  num_hidden_layers={layers}, num_attention_heads={heads},
                  num_key_value_heads={kv_heads}, max_position_embeddings=4096)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)          # initialised in fp32 on the GPU
model = model.to(torch.bfloat16).eval()    # the fp32 copy is freed, and cached by PyTorch
prompt = torch.randint(0, 32000, ({batch}, {prompt}), device="cuda")
with torch.no_grad():
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                         max_new_tokens={new_tokens}, return_dict_in_generate=True,
                         pad_token_id=0)
kv = out.past_key_values                   # the KV cache stays in the notebook
def sample():
    with torch.no_grad():
        logits = model(out.sequences[:, -64:]).logits[:, -1].float()
    return torch.multinomial(torch.softmax(logits, -1), 8, replacement=True).tolist()
torch.cuda.synchronize()
build_s = time.perf_counter() - _t
params = sum(p.numel() for p in model.parameters())
"""

PINNED = """
import sys, time, torch
n = int(sys.argv[1])
d = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
torch.cuda.synchronize()
d2h = h2d = float("inf")
for _ in range(3):
    t = time.perf_counter(); h.copy_(d, non_blocking=True); torch.cuda.synchronize()
    d2h = min(d2h, time.perf_counter() - t)
    t = time.perf_counter(); d.copy_(h, non_blocking=True); torch.cuda.synchronize()
    h2d = min(h2d, time.perf_counter() - t)
print(n / d2h, n / h2d)
"""


def pinned_bandwidth(nbytes: int) -> tuple[float, float]:
    """Bytes/s of pinned device-to-host and host-to-device copies (another process)."""
    done = subprocess.run([sys.executable, "-c", PINNED, str(nbytes)], capture_output=True,
                          text=True, check=True)
    d2h, h2d = done.stdout.split()
    return float(d2h), float(h2d)


def nvidia_smi_used(pids: list[int]) -> int:
    """Bytes of GPU memory nvidia-smi reports for these processes."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    used = 0
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids:
            used += int(mib.strip() or 0) << 20
    return used


def _reply_after(kc, msg_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id:
            assert msg["content"]["status"] == "ok", msg["content"]
            return


SMALL_CHANGE = ("with torch.no_grad():\n"
                "    _w = model.model.layers[0].mlp.down_proj.weight\n"
                "    _saved = _w.clone(); _w.add_(1e-3)")
UNDO_SMALL_CHANGE = ("with torch.no_grad():\n"
                     "    model.model.layers[0].mlp.down_proj.weight.copy_(_saved); del _saved, _w")

# Helper phases during which the kernel is held: its CUDA work locked (cuda_checkpoint), or
# past the CRIU dump with its GPU state still checkpointed. Not "store": the kernel runs again
# while the store ingests, so a cell sent then measures nothing of the pause.
HELD_PHASES = ("cuda_checkpoint", "verify", "publish", "cuda_resume")
NEXT_CELL = "torch.cuda.synchronize(); next_cell = 1"


def snapshot_with_next_cell(server, kernel, kernel_id: str, message: str,
                            next_cell: str = NEXT_CELL) -> dict:
    """POST a snapshot (Snapshot pressed); once the helper holds the kernel, send the next
    cell (one that uses the GPU, so it waits for the GPU too), as a user would; time its
    answer from the press, and the durable commit (the 201)."""
    out: dict = {}
    t0 = time.perf_counter()

    def post() -> None:
        out["code"], out["body"] = server.request(
            "POST", "/infinijup/snapshot", {"kernel_id": kernel_id, "message": message},
            timeout=3600)
        out["durable_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=post)
    thread.start()
    while thread.is_alive():
        _, st = server.request("GET", f"/infinijup/status?kernel_id={kernel_id}")
        op = st.get("operation")
        if op is not None and op["phase"] in HELD_PHASES:
            out["next_cell_sent_in"] = op["phase"]
            break
        time.sleep(0.005)
    _reply_after(kernel.kc, kernel.kc.execute(next_cell, store_history=False))
    out["next_cell_s"] = time.perf_counter() - t0
    thread.join()
    assert out["code"] == 201, out
    return out


def restore_timed(server, kernel, kernel_id: str, commit: str, expect: str) -> dict:
    t0 = time.perf_counter()
    code, body = server.request("POST", "/infinijup/restore",
                                {"kernel_id": kernel_id, "commit": commit}, timeout=3600)
    assert code == 200, body
    took = time.perf_counter() - t0
    kernel.wait_answering(timeout=300)
    drawn = kernel.evaluate(s="sample()")["s"]
    assert drawn == expect, f"sampling after the restore drew {drawn}, not {expect}"
    return {"s": took, "phases": body.get("phases", {})}


def packs_read_floor(store: Path) -> tuple[float, float]:
    """The floor of a cold restore's reads: every pack file of the store read once, page
    cache dropped first (GB, GB/s)."""
    if not drop_page_cache():
        return 0.0, float("nan")
    nbytes, seconds = read_packs(store)
    return nbytes / GB, nbytes / GB / seconds


def llama_row(name: str, work: str, hot_tier_bytes: int | None, shm: Path,
              allocator: str = "vmm", arena: str = "helper") -> dict:
    shape = MODELS[name]
    row: dict = {"run": f"{name} {work} {allocator}" + (f" {arena}" if allocator == "vmm" else "")}
    os.environ["INFINIJUP_GPU_ALLOCATOR"] = allocator  # read by the server's kernels
    if arena == "shm":  # the arena in /dev/shm (4 KiB pages), as without the helper's mount
        os.environ["INFINIJUP_GPU_ARENA_ROOT"] = f"/dev/shm/infinijup-{os.getuid()}"
    else:  # the helper's tmpfs with huge pages (infinijup_helper/arena.py)
        os.environ.pop("INFINIJUP_GPU_ARENA_ROOT", None)
    work_dir = tempfile.mkdtemp(prefix="ijbench-work-", dir="/dev/shm") if work == "tmpfs" \
        else None
    mounts = contextlib.ExitStack()
    if work == "hugetmpfs":  # a tmpfs of its own with huge pages, as an admin could mount
        work_dir = mounts.enter_context(huge_tmpfs())
    daemon = start_helper(work_dir)
    base = make_base()
    store = tempfile.mkdtemp(prefix="ijbench-store-", dir="/var/tmp")
    manager = {"busy_timeout": 600.0, "answer_timeout": 600.0}
    if hot_tier_bytes is not None:
        manager["hot_tier_bytes"] = hot_tier_bytes
    server = start_server(base, daemon.socket_path, store, manager)
    kernel = None
    try:
        kernel_id = server.open_session("llama.ipynb")
        kernel = server.kernel_client(kernel_id)
        execute(kernel.kc, BUILD.format(**shape, batch=BATCH, prompt=PROMPT,
                                        new_tokens=NEW_TOKENS), timeout=1800)
        ev = kernel.evaluate(params="params", build="build_s",
                             reserved="torch.cuda.memory_reserved()",
                             live="torch.cuda.memory_allocated()")
        root = kernel_root(kernel_id)
        pids = [root] + [p.pid for p in __import__("psutil").Process(root).children(True)]
        row.update(params_b=int(ev["params"]) / 1e9, build_s=float(ev["build"]),
                   vram_reserved_gb=int(ev["reserved"]) / GB, vram_live_gb=int(ev["live"]) / GB,
                   vram_smi_gb=nvidia_smi_used(pids) / GB, rss_gb=tree_rss(root) / GB)
        head_dim = shape["hidden"] // shape["heads"]
        row["kv_cache_gb"] = (2 * shape["layers"] * shape["kv_heads"] * head_dim * 2 * BATCH
                              * (PROMPT + NEW_TOKENS)) / GB

        # Snapshot pressed; the next cell sent as soon as the kernel is in its dump.
        snap = snapshot_with_next_cell(server, kernel, kernel_id, "llama")
        body = snap["body"]
        commit = body["commit"]
        stats = body["stats"]
        release = stats.get("gpu_release") or {}
        row.update(next_cell_s=snap["next_cell_s"], durable_s=snap["durable_s"],
                   next_cell_sent_in=snap.get("next_cell_sent_in", "(not while held)"),
                   pause_s=stats["pause_s"], quiesce_s=stats["quiesce_s"],
                   running_again_s=stats.get("running_again_s"), ingest_s=stats.get("store_s"),
                   image_gb=stats["image_bytes"] / GB, stored_gb=stats["stored_bytes"] / GB,
                   hot_kept=stats.get("hot"),
                   released_gb=(release.get("reserved_before", 0)
                                - release.get("reserved_after", 0)) / GB,
                   reserved_after_release_gb=release.get("reserved_after", 0) / GB)
        _, hist = server.request("GET", f"/infinijup/history?kernel_id={kernel_id}")
        meta = next(c for c in hist["commits"] if c["id"] == commit)["metadata"]
        timings = meta.get("timings") or {}
        row.update(cuda_checkpoint_s=timings.get("helper_cuda_checkpoint_s"),
                   criu_dump_s=timings.get("helper_dump_s"),
                   cuda_resume_s=timings.get("helper_cuda_resume_s"),
                   publish_s=timings.get("helper_publish_s"),
                   vram_saved_gb=sum(((meta.get("gpu") or {}).get("vram_bytes") or {}).values())
                   / GB)
        segments = stats.get("gpu_segments") or {}
        row.update(segments_gb=segments.get("bytes", 0) / GB,
                   segments_s=segments.get("seconds"),
                   segments_parts=segment_parts(segments),
                   pause_with_quiesce_s=stats["pause_s"] + stats["quiesce_s"])
        expect = kernel.evaluate(s="sample()")["s"]  # the draw right after the snapshot

        # A second snapshot after a cell that changed a few tensors (one MLP's weights).
        execute(kernel.kc, SMALL_CHANGE, timeout=600)
        second = snapshot_with_next_cell(server, kernel, kernel_id, "llama, one MLP changed")
        s2 = second["body"]["stats"]
        seg2 = s2.get("gpu_segments") or {}
        row.update(second_pause_s=s2["pause_s"],
                   second_pause_with_quiesce_s=s2["pause_s"] + s2["quiesce_s"],
                   second_quiesce_s=s2["quiesce_s"],
                   second_segments_gb=seg2.get("bytes", 0) / GB,
                   second_segments_parts=segment_parts(seg2),
                   second_next_cell_s=second["next_cell_s"],
                   second_stored_gb=s2["stored_bytes"] / GB,
                   second_stored_vs_live=s2["stored_bytes"] / int(ev["live"]))
        execute(kernel.kc, UNDO_SMALL_CHANGE, timeout=600)

        # Floors, on the same process in the same (released) state.
        from infinijup_helper import cuda_driver as driver
        from infinijup_helper.cuda_stage import cuda_pids

        cpids = cuda_pids(root)
        t0 = time.perf_counter()
        for p in cpids:
            driver.suspend(p, 120_000)
        row["driver_checkpoint_s"] = time.perf_counter() - t0
        raw = shm / "raw"
        raw.mkdir()
        t0 = time.perf_counter()
        raw_dump = subprocess.run([CRIU, "dump", "-t", str(root), "-D", str(raw),
                                   "--leave-running", "--tcp-established", "--network-lock",
                                   "skip", "--file-locks", "-o", "dump.log"], capture_output=True)
        if raw_dump.returncode == 0:
            row["raw_dump_tmpfs_s"] = time.perf_counter() - t0
            row["raw_image_gb"] = sum(f.stat().st_size for f in raw.iterdir()) / GB
        else:  # the floor is missing from the row, the log's end says why
            row["raw_dump_tmpfs_s"] = float("nan")
            log = (raw / "dump.log").read_text(errors="replace").splitlines()[-15:]
            print("raw CRIU dump failed:\n" + "\n".join(log), file=sys.stderr, flush=True)
        shutil.rmtree(raw)
        t0 = time.perf_counter()
        for p in cpids:
            driver.resume(p)
        row["driver_restore_s"] = time.perf_counter() - t0
        kernel.wait_answering(timeout=120)
        live = int(ev["live"])
        d2h, h2d = pinned_bandwidth(min(live, 8 << 30))
        row.update(pinned_d2h_gbs=d2h / GB, pinned_h2d_gbs=h2d / GB)

        # Restore to the first answer: from the hot tier, then from the store.
        hot = restore_timed(server, kernel, kernel_id, commit, expect)
        row.update(restore_hot_s=hot["s"], hot_source=hot["phases"].get("images"),
                   hot_checkout_s=hot["phases"].get("checkout_s"),
                   hot_criu_restore_s=hot["phases"].get("restore"),
                   hot_cuda_restore_s=hot["phases"].get("cuda_restore"),
                   hot_answer_s=hot["phases"].get("answer_s"))
        tier = Path(daemon.work_dir) / str(os.getuid()) / "hot"
        shutil.rmtree(tier / commit, ignore_errors=True)
        (tier / f"{commit}.json").unlink(missing_ok=True)
        row["page_cache_dropped"] = drop_page_cache()
        cold = restore_timed(server, kernel, kernel_id, commit, expect)
        row.update(restore_cold_s=cold["s"], cold_source=cold["phases"].get("images"),
                   cold_checkout_s=cold["phases"].get("checkout_s"),
                   cold_criu_restore_s=cold["phases"].get("restore"),
                   cold_cuda_restore_s=cold["phases"].get("cuda_restore"),
                   cold_answer_s=cold["phases"].get("answer_s"))
        row["sampling_equal"] = True  # restore_timed asserted it, hot and cold
        row["packs_gb"], row["packs_read_cold_gbs"] = packs_read_floor(Path(store))

        # Last (its image would push the first out of a small disk's hot tier): %snapshot,
        # whose cell returns once the kernel is dumped; then its durable commit.
        t0 = time.perf_counter()
        execute(kernel.kc, "%snapshot -m magic", timeout=3600)
        row["magic_cell_s"] = time.perf_counter() - t0
        server.request("GET", f"/infinijup/history?kernel_id={kernel_id}", timeout=3600)
        row["magic_durable_s"] = time.perf_counter() - t0
    finally:
        if kernel is not None:
            kernel.close()
        server.stop()
        daemon.stop()
        mounts.close()
        for path in (store, base, work_dir):
            if path:
                shutil.rmtree(path, ignore_errors=True)
    floor = row["driver_checkpoint_s"] + row["raw_dump_tmpfs_s"] + row["driver_restore_s"]
    row["pause_vs_floor"] = row["pause_s"] / floor
    row["pause_vs_pcie"] = row["pause_s"] / (live / (row["pinned_d2h_gbs"] * GB))
    row["image_vs_live_rss"] = row["image_gb"] / (row["vram_live_gb"] + row["rss_gb"])
    row["restore_hot_vs_driver"] = row["restore_hot_s"] / row["driver_restore_s"]
    return row


LLAMA_METRICS = [
    ("params_b", "parameters (B)"), ("build_s", "model build s"),
    ("vram_reserved_gb", "VRAM reserved before release GB"),
    ("vram_live_gb", "VRAM live (allocated) GB"), ("vram_smi_gb", "VRAM used (nvidia-smi) GB"),
    ("kv_cache_gb", "of which KV cache GB"), ("rss_gb", "kernel RSS GB"),
    ("released_gb", "released by quiesce GB"),
    ("reserved_after_release_gb", "VRAM reserved after release GB"),
    ("vram_saved_gb", "VRAM saved by the driver GB"),
    ("image_gb", "image GB"), ("image_vs_live_rss", "image / (live VRAM + RSS)"),
    ("stored_gb", "stored GB (empty store)"),
    ("quiesce_s", "quiesce s"), ("cuda_checkpoint_s", "CUDA checkpoint s"),
    ("criu_dump_s", "CRIU dump s"), ("cuda_resume_s", "CUDA resume s"),
    ("publish_s", "publish s"), ("pause_s", "pause s"),
    ("segments_gb", "VMM segments moved GB"), ("segments_s", "VMM segments out s (in quiesce)"),
    ("segments_parts", f"  of which {PARTS_LABEL} s"),
    ("pause_with_quiesce_s", "quiesce + pause s"),
    ("next_cell_s", "next cell answered after Snapshot s"),
    ("running_again_s", "kernel running again s"), ("ingest_s", "ingest s"),
    ("durable_s", "durable commit (201) s"), ("hot_kept", "kept hot"),
    ("magic_cell_s", "%snapshot cell s"), ("magic_durable_s", "%snapshot durable s"),
    ("driver_checkpoint_s", "floor: driver checkpoint s"),
    ("raw_dump_tmpfs_s", "floor: raw CRIU dump to tmpfs s"),
    ("raw_image_gb", "floor: raw image GB"),
    ("driver_restore_s", "floor: driver restore s"),
    ("pinned_d2h_gbs", "floor: pinned D2H GB/s"), ("pinned_h2d_gbs", "floor: pinned H2D GB/s"),
    ("pause_vs_floor", "pause / (driver ckpt + raw dump + driver restore)"),
    ("pause_vs_pcie", "pause / (live VRAM at pinned D2H)"),
    ("second_pause_with_quiesce_s", "2nd snapshot (one MLP changed): quiesce + pause s"),
    ("second_quiesce_s", "2nd: quiesce s"), ("second_segments_gb", "2nd: VMM segments copied GB"),
    ("second_segments_parts", f"2nd: {PARTS_LABEL} s"),
    ("second_next_cell_s", "2nd: next cell answered after Snapshot s"),
    ("second_stored_gb", "2nd: stored GB"), ("second_stored_vs_live", "2nd: stored / live VRAM"),
    ("restore_hot_s", "restore to first answer, hot s"), ("hot_source", "images from"),
    ("hot_checkout_s", "hot: images ready s"), ("hot_criu_restore_s", "hot: CRIU restore s"),
    ("hot_cuda_restore_s", "hot: CUDA restore s"), ("hot_answer_s", "hot: answer s"),
    ("restore_hot_vs_driver", "restore hot / driver restore"),
    ("restore_cold_s", "restore to first answer, cold s"), ("cold_source", "images from"),
    ("cold_checkout_s", "cold: store checkout s"), ("cold_criu_restore_s", "cold: CRIU restore s"),
    ("cold_cuda_restore_s", "cold: CUDA restore s"), ("cold_answer_s", "cold: answer s"),
    ("page_cache_dropped", "page cache dropped before cold"),
    ("packs_gb", "store's packs GB"), ("packs_read_cold_gbs", "floor: packs read cold GB/s"),
    ("sampling_equal", "sampling after restore equal"),
]

AIMS = [("pause_s", 8.0, "pause <= 8 s"), ("next_cell_s", 8.0, "next cell <= 8 s"),
        ("restore_hot_s", 8.0, "restore hot <= 8 s"), ("restore_cold_s", 15.0, "restore cold <= 15 s"),
        ("image_vs_live_rss", 1.2, "image <= 1.2 x (live VRAM + RSS)")]
# Issue 13's, for the VMM allocator's rows (4-5 B model): the kernel's whole pause, quiesce
# included; a second snapshot after a small change; restore from the hot tier.
AIMS_13 = [("pause_with_quiesce_s", 2.0, "first snapshot quiesce + pause <= 2 s"),
           ("second_pause_with_quiesce_s", 1.0, "second snapshot quiesce + pause <= 1 s"),
           ("second_stored_vs_live", 0.05, "second snapshot stores <= 5% of live VRAM"),
           ("restore_hot_s", 3.0, "restore to first answer from the hot tier <= 3 s")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="*", default=None,
                    help="synthetic rows, GB of VRAM (default 1 4 16 unless --llama is given)")
    ap.add_argument("--llama", nargs="*", default=[], choices=sorted(MODELS),
                    help="Llama-shaped notebook rows through a real server")
    ap.add_argument("--work", nargs="+", default=["disk"], choices=["disk", "tmpfs", "hugetmpfs"],
                    help="where the helper's work dir (dumps, hot tier) is, for --llama rows: "
                         "on disk, in /dev/shm, or on a tmpfs mounted with huge=within_size")
    ap.add_argument("--hot-tier-gib", type=float, default=None,
                    help="SnapshotManager.hot_tier_bytes for --llama rows (default: its own)")
    ap.add_argument("--allocator", nargs="+", default=["vmm"], choices=["vmm", "driver"],
                    help="for --llama rows: Infinijup's VMM allocator (the default) or the "
                         "driver's checkpoint of all GPU memory (INFINIJUP_GPU_ALLOCATOR=driver)")
    ap.add_argument("--arena", nargs="+", default=["helper"], choices=["helper", "shm"],
                    help="for --llama vmm rows: the GPU arena in the helper's tmpfs with huge "
                         "pages (the default) or in /dev/shm")
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    sizes = args.sizes if args.sizes is not None else ([] if args.llama else [1, 4, 16])
    use_infinijup_kernelspec()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    rows = []
    if sizes:
        daemon = start_helper()
        try:
            for size in sizes:
                store = Path(args.store or tempfile.mkdtemp(prefix="ijbench-store-")) / f"s{size}"
                shm = Path(tempfile.mkdtemp(prefix="ijbench-", dir="/dev/shm"))
                try:
                    row = one_size(size, store, shm)
                finally:
                    shutil.rmtree(store, ignore_errors=True)
                    shutil.rmtree(shm, ignore_errors=True)
                row["pause_ratio"] = row["pause_s"] / (row["driver_checkpoint_s"]
                                                       + row["raw_dump_s"] + row["driver_restore_s"])
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            daemon.stop()
    llama_rows = []
    hot = int(args.hot_tier_gib * (1 << 30)) if args.hot_tier_gib is not None else None
    for name in args.llama:
        for work in args.work:
            for allocator, arena in [(a, r) for a in args.allocator
                                     for r in (args.arena if a == "vmm" else ["-"])]:
                shm = Path(tempfile.mkdtemp(prefix="ijbench-", dir="/dev/shm"))
                try:
                    row = llama_row(name, work, hot, shm, allocator, arena)
                finally:
                    shutil.rmtree(shm, ignore_errors=True)
                llama_rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nGPU: {gpu}; {time.strftime('%Y-%m-%d')}; one run per row\n")
    if rows:
        print(markdown_table(rows, COLUMNS))
    if llama_rows:
        print()
        print(transposed_table(llama_rows, [r["run"] for r in llama_rows], LLAMA_METRICS))
        print()
        for r in llama_rows:
            met = [f"{label}: {'met' if r.get(key, float('inf')) <= limit else 'missed'} "
                   f"({r.get(key, float('nan')):.3g})" for key, limit, label in AIMS]
            print(f"aims, {r['run']}: " + "; ".join(met))
            if r["run"].split()[2] == "vmm":
                met = [f"{label}: {'met' if r.get(key, float('inf')) <= limit else 'missed'} "
                       f"({r.get(key, float('nan')):.3g})" for key, limit, label in AIMS_13]
                print(f"issue 13 aims, {r['run']}: " + "; ".join(met))


if __name__ == "__main__":
    main()
