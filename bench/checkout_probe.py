"""Where a cold store checkout of a GPU kernel's images goes: a probe, not a bench of record.

Builds a store holding one ``gpu-like`` image (bf16 weights and zero regions, as
bench/store_bench.py writes it) of ``--gib`` GiB, then, for each thread count, with the page
cache dropped ("cold") and not ("warm"): the file's chunk list and the index's lookups of its
chunks alone, the whole ``checkout_dir`` into ``--target``, and the floor (every pack read
once, 8 threads, 8 MiB reads), and the CPU seconds per wall second of the checkout (how
many cores it kept busy: this process and the worker processes it waited for, which write
files of 1 GiB or more on machines of 4 cores or more). ``--baseline-dir DIR``: also the ``checkout_dir`` of
a copy of the store package at DIR (``git archive REF infinijup/store``), alternating with
this tree's in each run. Needs root (drop_caches). Prints a markdown table.

    python3 bench/checkout_probe.py --gib 10 --dir /var/tmp --target /mnt/ha --threads 8 16
"""

from __future__ import annotations

import argparse
import importlib
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import drop_page_cache, read_packs  # noqa: E402
from store_bench import other_image  # noqa: E402

from infinijup.store import Repository  # noqa: E402
from infinijup.store.checkout import checkout_dir  # noqa: E402

GB = 1e9


def cpu_s() -> float:
    """CPU seconds of this process and of its children waited for."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def lookups(repo: Repository, commit: str) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    tree = repo.get_tree(repo.get_commit(commit).tree)
    chunks: list[bytes] = []
    for entry in tree:
        chunks += repo.get_blob_chunks(entry.id)[1]
    t1 = time.perf_counter()
    repo.index.lookup_many(chunks)
    return t1 - t0, time.perf_counter() - t1, len(chunks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=10)
    ap.add_argument("--dir", default="/var/tmp", help="where the store lives")
    ap.add_argument("--target", default="/dev/shm", help="where checkouts are written")
    ap.add_argument("--threads", type=int, nargs="+", default=[8])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--baseline-dir", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ijprobe-", dir=args.dir))
    image = other_image(work, "gpu-like", int(args.gib * 1024))
    src = next(iter(image.values()))
    store = work / "store"
    repo = Repository.open_or_init(store)
    t0 = time.perf_counter()
    commit = repo.commit_dir(src, thread="probe").id
    ingest_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in Path(src).iterdir())
    shutil.rmtree(src)
    versions = {"this tree": checkout_dir}
    if args.baseline_dir:
        pkg = work / "base" / "ijbase"  # as infinijup/, for the store's `..errors`
        shutil.copytree(args.baseline_dir, pkg / "store")
        (pkg / "__init__.py").write_text("")
        shutil.copy(Path(__file__).resolve().parents[1] / "infinijup" / "errors.py", pkg)
        sys.path.insert(0, str(work / "base"))
        versions["baseline"] = importlib.import_module("ijbase.store.checkout").checkout_dir
    rows = []
    try:
        for threads in args.threads:
            for state in ("cold", "warm"):
                got: dict[str, dict[str, list[float]]] = {
                    v: {"chunks": [], "lookup": [], "checkout": [], "cores": [], "floor": []}
                    for v in versions}
                for _ in range(args.runs):
                    for version, checkout in versions.items():
                        g = got[version]
                        if state == "cold":
                            drop_page_cache()
                        c, lk, n = lookups(repo, commit)
                        g["chunks"].append(c)
                        g["lookup"].append(lk)
                        if state == "cold":
                            drop_page_cache()
                        out = Path(tempfile.mkdtemp(prefix="ijco-", dir=args.target)) / "t"
                        cpu0 = cpu_s()
                        t0 = time.perf_counter()
                        checkout(repo, commit, out, threads=threads)
                        wall = time.perf_counter() - t0
                        g["checkout"].append(wall)
                        g["cores"].append((cpu_s() - cpu0) / wall)
                        shutil.rmtree(out.parent)
                        if state == "cold":
                            drop_page_cache()
                        packs, floor_s = read_packs(store)
                        g["floor"].append(floor_s)
                for version in versions:
                    med = {k: statistics.median(v) for k, v in got[version].items()}
                    rows.append((version, threads, state, n, packs, med))
                    print(version, threads, state, got[version], flush=True)
    finally:
        repo.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nimage {size / GB:.2f} GB (gpu-like), ingest {ingest_s:.2f} s; medians of "
          f"{args.runs}; store in {args.dir}, checkout into {args.target}\n")
    print("| checkout | threads | cache | chunks | packs GB | chunk lists s | index lookups s "
          "| checkout s | checkout GB/s (image) | cores busy | packs read s (floor) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for version, threads, state, n, packs, m in rows:
        print(f"| {version} | {threads} | {state} | {n} | {packs / GB:.2f} | {m['chunks']:.3f} "
              f"| {m['lookup']:.3f} | {m['checkout']:.2f} | {size / GB / m['checkout']:.2f} | "
              f"{m['cores']:.1f} | {m['floor']:.2f} |")


if __name__ == "__main__":
    main()
