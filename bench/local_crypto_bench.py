"""Restore speed of an encrypted local store against a plain one; prints a markdown table.

    .venv/bin/python bench/local_crypto_bench.py [--size-mib 512] [--runs 7] [--dir /var/tmp]
        [--threads N]

One image (``python-like``: 45% random float64 pages, 30% int64 patterns, 25% pickled
dicts, so that about half of it compresses) is committed to a plain store and to an
encrypted one (``Repository.init(encrypt=...)``), then checked out of each, the two
alternating which goes first, ``--runs`` times; the table gives medians of wall time and of
the process's CPU seconds (all threads), and the encrypted store's time as a share of the
plain one's (issue 31 aims at no more than 110%). Checkouts read warm packs (both stores'
packs fit in the page cache), so the table measures the CPU work restore adds or saves:
opening each chunk (AES-256-GCM), where a plain store re-hashes it (BLAKE3; an encrypted
store's checkout relies on the tags, docs/store.md). This is the checkout alone; a kernel's
restore through the store is bench/encrypted_restore_bench.py. ``--threads 1`` checks out on one
thread (the CPU seconds are then least disturbed by other work on the machine); the default
is the store's (one per core, at most 8).
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infinijup.store import Repository  # noqa: E402
from infinijup.store.checkout import checkout_dir  # noqa: E402
from infinijup.store.keys import Credentials  # noqa: E402

PAGE = 4096


def python_like(size: int, seed: int = 3) -> bytes:
    """An image like a Python kernel's heap (see the module docs)."""
    rng = np.random.default_rng(seed)
    pages = size // PAGE
    a, b = int(pages * 0.45), int(pages * 0.30)
    floats = rng.standard_normal(a * PAGE // 8).astype(np.float64).tobytes()
    ints = (np.arange(b * PAGE // 8, dtype=np.int64) * 3 % 1000).tobytes()
    dicts = bytearray()
    i = 0
    while len(dicts) < (pages - a - b) * PAGE:
        dicts += pickle.dumps({f"key{i}": [i, i * 2.5, f"value {i}"] for i in range(i, i + 64)})
        i += 64
    return floats + ints + bytes(dicts[:(pages - a - b) * PAGE])


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ij-localcrypto-", dir=args.dir))
    try:
        image = work / "img"
        image.mkdir()
        (image / "pages.img").write_bytes(python_like(args.size_mib << 20))
        pw = work / "pw"
        pw.write_text("bench password\n")
        creds = Credentials.build(password_file=pw)
        stores: dict[str, Repository] = {
            "plain": Repository.init(work / "plain"),
            "encrypted": Repository.init(work / "enc", encrypt=creds),
        }
        ingest, stored, commits = {}, {}, {}
        for name, repo in stores.items():
            t = time.perf_counter()
            c = repo.commit_dir(image, thread="bench")
            ingest[name] = time.perf_counter() - t
            stored[name] = c.stats["stored_bytes"]
            commits[name] = c.id
        stores["encrypted"].close()
        t = time.perf_counter()  # what every process pays to open it (one Argon2id)
        stores["encrypted"] = Repository.open(work / "enc", credentials=creds)
        unlock = time.perf_counter() - t
        wall: dict[str, list[float]] = {n: [] for n in stores}
        cpus: dict[str, list[float]] = {n: [] for n in stores}
        expected = (image / "pages.img").stat().st_size
        for run in range(args.runs):
            order = list(stores) if run % 2 == 0 else list(reversed(stores))
            for name in order:
                out = work / f"out-{name}"
                c0, t0 = cpu(), time.perf_counter()
                checkout_dir(stores[name], commits[name], out, threads=args.threads)
                wall[name].append(time.perf_counter() - t0)
                cpus[name].append(cpu() - c0)
                assert (out / "pages.img").stat().st_size == expected
                shutil.rmtree(out)
        for repo in stores.values():
            repo.close()
        mib = expected / (1 << 20)
        print(f"Machine: {platform.node()}, {os.cpu_count()} cores, Python "
              f"{platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
              f"; image {mib:.0f} MiB python-like, {args.runs} checkouts each, alternating, "
              f"{args.threads or 'default'} threads; "
              f"unlocking the encrypted store at open: {unlock:.2f} s")
        print()
        print("| store | stored MiB | ingest s | checkout s (median) | MiB/s | CPU s (median) "
              "| vs plain |")
        print("|---|---|---|---|---|---|---|")
        base = statistics.median(wall["plain"])
        for name in stores:
            med = statistics.median(wall[name])
            print(f"| {name} | {stored[name] / (1 << 20):.1f} | {ingest[name]:.2f} | {med:.3f} "
                  f"| {mib / med:.0f} | {statistics.median(cpus[name]):.2f} | "
                  f"{100 * med / base:.0f}% |")
        print()
        print("all runs (s): " + "; ".join(
            f"{n}: " + ", ".join(f"{x:.3f}" for x in wall[n]) for n in stores))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
