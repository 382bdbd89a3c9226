"""What the store's ingest, running beside a kernel, costs the kernel's cell, at the server's
priority and niced (issue 30: an automatic snapshot's images are stored while the next cells
run; engine/niced.py).

A "cell" (another process, as a kernel is: numpy histograms of 32M values, a fixed amount of
work) runs while this process ingests an image-sized file of random bytes into a store, over
and over until the cell ends, through ``run_niced`` with each nice value asked for; and once
with no ingest beside it. The conditions run in turn, ``--rounds`` times; printed: each one's
median cell time and the ingest's rate while the cell ran (whole passes over the file that
ended before the cell did, over the cell's time: a lower bound).

    python bench/ingest_nice_probe.py [--mib 2048] [--nice 0 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from infinijup.engine.niced import run_niced  # noqa: E402
from infinijup.store import Repository  # noqa: E402

CELL = """
import numpy as np, time
x = np.random.default_rng(1).random(32 << 20)
t0 = time.perf_counter()
for _ in range(4):
    np.histogram(x, bins=50)
print(time.perf_counter() - t0)
"""


def cell_beside(store: Path, image: Path, nice: int | None) -> tuple[float, int]:
    """The cell's seconds, and the bytes of the ingests that ended while it ran (None: no
    ingest)."""
    proc = subprocess.Popen([sys.executable, "-c", CELL], stdout=subprocess.PIPE, text=True)
    done = threading.Event()
    ingested = [0]

    def ingest() -> None:
        repo = Repository.open_or_init(store)
        try:
            while not done.is_set():
                with repo.writer() as w:
                    w.add_file(image)
                if not done.is_set():
                    ingested[0] += image.stat().st_size
        finally:
            repo.close()

    worker = None
    if nice is not None:
        worker = threading.Thread(target=run_niced, args=(ingest, nice))
        worker.start()
    out, _ = proc.communicate()
    done.set()
    if worker is not None:
        worker.join()
    return float(out.strip()), ingested[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=2048, help="the image's size")
    p.add_argument("--nice", type=int, nargs="+", default=[0, 10])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    conditions: list[int | None] = [None, *args.nice]
    times: dict[int | None, list[float]] = {c: [] for c in conditions}
    rates: dict[int | None, list[float]] = {c: [] for c in conditions}
    with tempfile.TemporaryDirectory(prefix="ingest-nice-", dir="/var/tmp") as tmp:
        image = Path(tmp) / "pages.img"
        with open(image, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        for r in range(args.rounds):
            for c in conditions:
                store = Path(tmp) / f"store-{r}-{c}"
                t, n = cell_beside(store, image, c)
                times[c].append(t)
                rates[c].append(n / t / 1e6)
                name = "no ingest" if c is None else f"ingest nice +{c}"
                print(f"round {r + 1}, {name}: cell {t:.2f} s, ingested {n / 1e9:.1f} GB "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print("| beside the cell | cell (median) | vs no ingest | ingest meanwhile |")
    print("|---|---|---|---|")
    base = statistics.median(times[None])
    for c in conditions:
        med = statistics.median(times[c])
        name = "nothing" if c is None else f"ingest, nice +{c}"
        rate = "-" if c is None else f"{statistics.median(rates[c]):.0f} MB/s"
        print(f"| {name} | {med:.2f} s | {(med / base - 1) * 100:+.0f}% | {rate} |")


if __name__ == "__main__":
    main()
