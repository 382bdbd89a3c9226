"""Snapshot and restore of idle CPU kernels holding 100 MiB, 1 GiB and 4 GiB of Python objects.

For each size, in one run and on the same kernel process: a raw `criu dump` of the kernel tree
to tmpfs (the floor), then Infinijup's snapshot (quiesce, CRIU dump through the helper, store
ingest) with its pause (the time the kernel is frozen), a second snapshot after a small cell
(bytes the store adds), and a restore (store checkout, kill + CRIU restore, first answered
execute request), then a resume of the same snapshot into a new kernel beside the running one
(kernel start, checkout, restore onto the new kernel's ports, first answer). Prints a markdown
table. Run as root with CRIU in place:

    python bench/kernel_bench.py [--sizes-mib 100 1024 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchkit import (
    CRIU,
    MiB,
    execute,
    first_answer,
    markdown_table,
    start_helper,
    use_infinijup_kernelspec,
)
from jupyter_client import KernelManager

from infinijup.engine import SnapshotEngine
from infinijup.engine.retarget import plan_retarget, saved_connection
from infinijup.helper_client import HelperClient
from infinijup.store import Repository


def raw_dump_s(root: int, shm: Path) -> float:
    target = shm / "raw"
    target.mkdir()
    t0 = time.perf_counter()
    subprocess.run([CRIU, "dump", "-t", str(root), "-D", str(target), "--leave-running",
                    "--tcp-established", "--network-lock", "skip", "--file-locks",
                    "-o", "dump.log"], check=True, capture_output=True)
    took = time.perf_counter() - t0
    shutil.rmtree(target)
    return took


def add_resume(engine: SnapshotEngine, km: KernelManager, commit_id: str, size_mib: int,
               add) -> None:
    """Start a new kernel, check the snapshot out, restore it onto the new kernel's ports
    (the original kernel keeps running beside it), first answer."""
    t0 = time.perf_counter()
    km2 = KernelManager(kernel_name="infinijup")
    km2.start_kernel()
    kc2 = km2.client()
    kc2.start_channels()
    try:
        kc2.wait_for_ready(timeout=120)
        add("kernel_start_s", time.perf_counter() - t0)
        images = engine.materialize(commit_id)
        retarget = plan_retarget(saved_connection(km.get_connection_info()),
                                 saved_connection(km2.get_connection_info()))
        km2.provisioner.restoring = True
        rres = engine.restore(images, km2.provisioner.root_pid, port_map=retarget.port_map,
                              log_path=km2.provisioner.log_path)
        km2.provisioner.attach(rres.pid)
        kc2.stop_channels()
        kc2 = km2.client()
        kc2.start_channels()
        first_answer(kc2)
        add("resume_total_s", time.perf_counter() - t0)
        execute(kc2, f"assert len(blobs) == {size_mib} and x == 0")
    finally:
        kc2.stop_channels()
        km2.shutdown_kernel(now=True)


def one_size(size_mib: int, repeat: int, store_dir: Path, shm: Path) -> dict:
    km = KernelManager(kernel_name="infinijup")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    samples: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    try:
        # Python objects: 1 MiB bytes objects of random data (the worst case for dedup and
        # compression), a dict indexing them, and a few small objects.
        execute(kc, f"import os; blobs = [os.urandom(2**20) for _ in range({size_mib})]; "
                    "index = {i: b[:16] for i, b in enumerate(blobs)}; x = 0")
        repo = Repository.open_or_init(store_dir)
        engine = SnapshotEngine(repo, HelperClient())
        parents: list[str] = []
        for i in range(repeat):
            root = km.provisioner.root_pid
            add("raw_dump_s", raw_dump_s(root, shm))
            first_answer(kc)
            t0 = time.perf_counter()
            res = engine.snapshot(root, thread="bench", message=f"{size_mib} MiB #{i}",
                                  metadata={}, parents=parents, expected_tip=parents[0] if parents else None)
            add("snapshot_s", time.perf_counter() - t0)
            add("pause_s", res.pause_s)
            add("image_mib", res.image_bytes / MiB)
            if i == 0:  # into an empty store; later rounds dedup against it
                add("stored_mib", res.stored_bytes / MiB)
            parents = [res.commit.id]
            # A small cell, then a second snapshot: what does it add?
            execute(kc, "x += 1; y = list(range(1000))")
            res2 = engine.snapshot(root, thread="bench", message="after a small cell",
                                   metadata={}, parents=parents, expected_tip=parents[0])
            add("second_stored_mib", res2.stored_bytes / MiB)
            add("second_pct", 100.0 * res2.stored_bytes / res2.image_bytes)
            parents = [res2.commit.id]
            # Restore the first snapshot: checkout, then kill + CRIU restore + first answer.
            t0 = time.perf_counter()
            images = engine.materialize(res.commit.id)
            add("checkout_s", time.perf_counter() - t0)
            km.provisioner.restoring = True
            t1 = time.perf_counter()
            rres = engine.restore(images, root)
            km.provisioner.attach(rres.pid)
            add("criu_restore_s", rres.phases.get("restore", 0.0))
            kc.stop_channels()
            kc = km.client()
            kc.start_channels()
            first_answer(kc)
            add("restore_to_answer_s", time.perf_counter() - t1)
            add("restore_total_s", time.perf_counter() - t0)
            execute(kc, f"assert len(blobs) == {size_mib} and x == 0")
            # Resume the same snapshot into a new kernel, beside the one above.
            add_resume(engine, km, res.commit.id, size_mib, add)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    row = {k: statistics.median(v) for k, v in samples.items()}
    row["size"] = f"{size_mib} MiB"
    row["pause_ratio"] = row["pause_s"] / row["raw_dump_s"]
    return row


COLUMNS = [
    ("size", "objects"), ("raw_dump_s", "raw criu dump to tmpfs s"), ("pause_s", "pause s"),
    ("pause_ratio", "pause / raw dump"), ("snapshot_s", "snapshot total s"),
    ("image_mib", "image MiB"), ("stored_mib", "1st snapshot stored MiB (empty store)"),
    ("second_stored_mib", "2nd stored MiB"), ("second_pct", "2nd stored % of image"),
    ("checkout_s", "checkout s"), ("criu_restore_s", "CRIU restore s"),
    ("restore_to_answer_s", "restore to first answer s"), ("restore_total_s", "restore incl. checkout s"),
    ("kernel_start_s", "new kernel start s"),
    ("resume_total_s", "resume into a new kernel (start + checkout + restore + answer) s"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[100, 1024, 4096])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    use_infinijup_kernelspec()
    daemon = start_helper()
    rows = []
    try:
        for size in args.sizes_mib:
            store = Path(tempfile.mkdtemp(prefix="ijbench-store-", dir="/var/tmp"))
            shm = Path(tempfile.mkdtemp(prefix="ijbench-", dir="/dev/shm"))
            try:
                rows.append(one_size(size, args.repeat, store, shm))
                print(json.dumps(rows[-1]), flush=True)
            finally:
                shutil.rmtree(store, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
    finally:
        daemon.stop()
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"],
                         capture_output=True, text=True).stdout.strip()
    print(f"\n{cpu}, {len(__import__('os').sched_getaffinity(0))} cores; "
          f"{time.strftime('%Y-%m-%d')}; medians of {args.repeat} runs per size\n")
    print(markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
