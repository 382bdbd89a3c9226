"""Issue 13: how fast CRIU dumps and restores a process's memory by where its images go.

A Python process holding N GB of anonymous memory (random bytes, as a kernel's heap after a
CUDA checkpoint holds the context's saved device memory) is dumped with ``--leave-running``
into a directory of each given tmpfs (/dev/shm: 4 KiB pages; one mounted ``huge=always``),
alternating, then restored from each (after killing it). Prints a markdown table of medians.

    python bench/criu_target_probe.py --criu PATH --gb 2.5 --runs 3 /dev/shm /mnt/huge
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HOLDER = """
import os, sys, time
blob = bytearray(os.urandom(int(float(sys.argv[1]) * 1e9)))
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def start(gb: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(gb)], stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    assert p.stdout.readline().strip() == b"ready"
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("places", nargs="+")
    ap.add_argument("--criu", required=True)
    ap.add_argument("--gb", type=float, default=2.5)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    times: dict = {p: {"dump": [], "restore": []} for p in args.places}
    for _ in range(args.runs):
        for place in args.places:
            proc = start(args.gb)
            d = tempfile.mkdtemp(dir=place, prefix="criu-probe-")
            t0 = time.perf_counter()
            subprocess.run([args.criu, "dump", "-t", str(proc.pid), "-D", d, "--leave-running",
                            "--shell-job", "-o", "dump.log"], check=True)
            times[place]["dump"].append(time.perf_counter() - t0)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            t0 = time.perf_counter()
            subprocess.run([args.criu, "restore", "-D", d, "-d", "--shell-job",
                            "-o", "restore.log"], check=True)
            times[place]["restore"].append(time.perf_counter() - t0)
            os.kill(proc.pid, signal.SIGKILL)
            shutil.rmtree(d)
    print(f"\n{args.gb:g} GB of anonymous memory, medians of {args.runs}, seconds")
    print("| images in | criu dump --leave-running | criu restore -d |")
    print("|---|---|---|")
    for place in args.places:
        print(f"| {place} | {statistics.median(times[place]['dump']):.3f} | "
              f"{statistics.median(times[place]['restore']):.3f} |")


if __name__ == "__main__":
    main()
