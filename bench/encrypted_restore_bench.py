"""A kernel's restore from an encrypted local store against a plain one (issue 31: "restores
from it stay within 10% of today's speed"), side by side; prints a markdown table.

    python3 bench/encrypted_restore_bench.py [--mib 1024] [--runs 5] [--modes whole lazy]

Run as root with CRIU in place (as bench/kernel_bench.py). One real ipykernel (Infinijup's
kernelspec, a jupyter_client KernelManager, the helper) holds about ``--mib`` MiB of Python
objects like a working kernel's: half random bytes in 1 MiB objects (stored raw), half a
list of ints (compresses). It is snapshotted once into a plain store and once into an
encrypted one (``Repository.init(encrypt=...)``), each through its own ``SnapshotEngine``
with the hot tier off, so every restore reads the store. Then, ``--runs`` times, the two
alternating which goes first, and for each restore mode, the kernel is restored in place
from each store as the server does it: the store checkout into the helper's work dir
(``engine.materialize``), the helper's restore replacing the kernel, the kernel's first
answer (``kernel_info``, polled every 50 ms). Modes: ``whole`` (CRIU restores every page
before the kernel runs); ``lazy`` (the server's default for a restore in place: the whole
checkout, then the pages stream in from it after the kernel runs); ``stream`` (lazy with
the page files left in the store and served from it as CRIU asks, engine/store_pages.py:
what the server does where no running kernel is replaced, a resume or a wake; not run by
default: slow while that path is being built, see docs/benchmarks.md). Lazy restores are let finish streaming before the next one; the
helper's time until all pages are back is reported. Medians of: checkout, restore to
first answer, and their sum (the user's wait), the encrypted store's as a share of the
plain one's; and the CPU seconds this process spent checking out (all threads: less
disturbed than wall times by other work on the machine). Packs are warm in the page cache
for both stores (they were just written).
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchkit import MiB, execute, start_helper, use_infinijup_kernelspec
from jupyter_client import KernelManager

from infinijup.engine import SnapshotEngine
from infinijup.helper_client import HelperClient
from infinijup.store import Repository
from infinijup.store.keys import Credentials

STORES = ("plain", "encrypted")


def first_reply(km: KernelManager, timeout: float = 300) -> None:
    """Until the restored kernel answers a ``kernel_info`` request (sent every 50 ms on a new
    client: requests sent while its sockets reconnect can be lost)."""
    kc = km.client()
    kc.start_channels()
    try:
        sent: set[str] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sent.add(kc.kernel_info())
            until = time.monotonic() + 0.05
            while time.monotonic() < until:
                try:
                    msg = kc.shell_channel.get_msg(timeout=0.005)
                except queue.Empty:
                    continue
                if msg["parent_header"].get("msg_id") in sent:
                    return
        raise TimeoutError("the restored kernel did not answer")
    finally:
        kc.stop_channels()


def cpu() -> float:
    """CPU seconds of this process so far (all threads: the checkout's)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def settle(helper: HelperClient, pid: int) -> float:
    """Wait until a lazily restored kernel's pages are all back; the helper's time from the
    restore's start until then."""
    deadline = time.monotonic() + 600
    while (pages := helper.status(pid).pages) and pages.get("state") == "streaming":
        if time.monotonic() > deadline:
            raise TimeoutError("pages still streaming")
        time.sleep(0.05)
    assert pages and pages.get("state") == "resident", pages
    return float(pages["resident_s"])


def restore_once(km: KernelManager, engine: SnapshotEngine, helper: HelperClient,
                 commit_id: str, mib: int, stream: bool) -> dict[str, float]:
    info: dict = {"pages_may_stream": stream}  # as the server's restore flow asks
    c0, t0 = cpu(), time.perf_counter()
    images = engine.materialize(commit_id, info)
    c1, t1 = cpu(), time.perf_counter()
    km.provisioner.restoring = True
    res = engine.restore(images, km.provisioner.root_pid)
    km.provisioner.attach(res.pid)
    first_reply(km)
    t2 = time.perf_counter()
    got = {"checkout": t1 - t0, "restore": t2 - t1, "total": t2 - t0, "cpu": c1 - c0,
           "from_store": float(bool(info.get("pages_from_store")))}
    if engine.lazy_restore:
        assert res.phases.get("pages"), f"restored whole: {res.phases.get('whole_why')}"
        got["resident"] = settle(helper, res.pid)
    kc = km.client()
    kc.start_channels()
    try:
        execute(kc, f"assert len(blobs) == {mib // 2} and ints[-1] == len(ints) - 1 "
                    "and x == 0")
    finally:
        kc.stop_channels()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", nargs="+", choices=("whole", "lazy", "stream"),
                    default=["whole", "lazy"])
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    use_infinijup_kernelspec()
    spec_dir = os.environ["JUPYTER_PATH"]
    daemon = start_helper()
    work = Path(tempfile.mkdtemp(prefix="ij-encrestore-", dir=args.dir))
    km = KernelManager(kernel_name="infinijup")
    try:
        pw = work / "pw"
        pw.write_text("bench password\n")
        repos = {"plain": Repository.init(work / "plain"),
                 "encrypted": Repository.init(work / "enc",
                                              encrypt=Credentials.build(password_file=pw))}
        helper = HelperClient()
        engines = {n: SnapshotEngine(r, helper) for n, r in repos.items()}
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        half = args.mib // 2
        n_ints = (half * MiB) // 36  # a small int object (28 bytes) and its list slot (8)
        execute(kc, f"import os; blobs = [os.urandom(2**20) for _ in range({half})]; "
                    f"ints = list(range({n_ints})); x = 0")
        kc.stop_channels()
        commits, image, stored = {}, {}, {}
        for name, engine in engines.items():
            res = engine.snapshot(km.provisioner.root_pid, thread="bench", message=name,
                                  metadata={}, parents=[], expected_tip=None)
            commits[name] = res.commit.id
            image[name], stored[name] = res.image_bytes / MiB, res.stored_bytes / MiB
        samples: dict[tuple[str, str], list[dict[str, float]]] = {}
        loads = [os.getloadavg()[0]]
        for run in range(args.runs):
            for mode in args.modes:
                order = STORES if run % 2 == 0 else STORES[::-1]
                for name in order:
                    engines[name].lazy_restore = mode != "whole"
                    got = restore_once(km, engines[name], helper, commits[name], args.mib,
                                       mode == "stream")
                    samples.setdefault((mode, name), []).append(got)
            loads.append(os.getloadavg()[0])
        for repo in repos.values():
            repo.close()
    finally:
        km.shutdown_kernel(now=True)
        daemon.stop()
        for path in (work, daemon.base, spec_dir):  # nothing of this run left behind
            shutil.rmtree(path, ignore_errors=True)
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"],
                         capture_output=True, text=True).stdout.strip()
    print(f"Machine: {platform.node()}, {cpu}, {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; a kernel of "
          f"{image['plain']:.0f} MiB of images (stored: plain {stored['plain']:.0f} MiB, "
          f"encrypted {stored['encrypted']:.0f} MiB); {args.runs} restores per store and "
          f"mode, alternating; load average (1 min) during the runs "
          f"{min(loads):.2f}-{max(loads):.2f}")
    print()
    print("| restore | store | checkout s | restore to first answer s | user's wait s "
          "| wait vs plain | checkout vs plain | checkout CPU s | all resident s (lazy) "
          "| pages from store |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        keys = ("checkout", "restore", "total", "cpu", "from_store") + (
            ("resident",) if mode != "whole" else ())
        med = {n: {k: statistics.median(s[k] for s in samples[(mode, n)]) for k in keys}
               for n in STORES}
        for name in STORES:
            m = med[name]
            resident = f"{m['resident']:.3f}" if "resident" in m else "-"
            print(f"| {mode} | {name} | {m['checkout']:.3f} | {m['restore']:.3f} | "
                  f"{m['total']:.3f} | {100 * m['total'] / med['plain']['total']:.0f}% | "
                  f"{100 * m['checkout'] / med['plain']['checkout']:.0f}% | {m['cpu']:.2f} | "
                  f"{resident} | "
                  f"{'yes' if m['from_store'] else 'no'} |")
    print()
    for (mode, name), runs in samples.items():
        print(f"{mode} {name} waits (s): " + ", ".join(f"{s['total']:.3f}" for s in runs))


if __name__ == "__main__":
    main()
