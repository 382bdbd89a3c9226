"""GPU snapshot and restore, phase by phase, against the driver's own floor.

For kernels holding N GB of VRAM (random data), in one run: the driver's lock+checkpoint and
restore+unlock alone on the same process, a raw `criu dump` of the checkpointed process to
tmpfs (the floor of a snapshot's pause), then Infinijup's snapshot (helper: CUDA checkpoint, CRIU
dump, CUDA resume; store ingest) and restore (store checkout, kill + CRIU restore, CUDA restore,
first execute answered). Prints a markdown table.

Run as root on the GPU machine, with the helper's requirements (CRIU, pycriu) in place:
    python bench/gpu_bench.py --sizes 1 4 16 [--store DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchkit import (
    CRIU,
    GB,
    execute,
    first_answer,
    markdown_table,
    start_helper,
    use_infinijup_kernelspec,
)
from jupyter_client import KernelManager

from infinijup.engine import SnapshotEngine
from infinijup.gpu import driver
from infinijup.helper_client import HelperClient
from infinijup.store import Repository
from infinijup_helper.cuda_stage import cuda_pids


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    use_infinijup_kernelspec()
    daemon = start_helper()
    rows = []
    try:
        for size in args.sizes:
            store = Path(args.store or tempfile.mkdtemp(prefix="ijbench-store-")) / f"s{size}"
            shm = Path(tempfile.mkdtemp(prefix="ijbench-", dir="/dev/shm"))
            try:
                row = one_size(size, store, shm)
            finally:
                shutil.rmtree(store, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
            row["pause_ratio"] = row["pause_s"] / (row["driver_checkpoint_s"] + row["raw_dump_s"]
                                                   + row["driver_restore_s"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        daemon.stop()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    print(f"\nGPU: {gpu}; {time.strftime('%Y-%m-%d')}; one run per size\n")
    print(markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
