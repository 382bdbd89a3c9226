"""Issue 13: where GPU memory can go on the host, and how fast. Before the VMM allocator's
segments are written into a file of the hot tier (so that CRIU records a mapping instead of
dumping the bytes), this measures each way of getting device memory into such a file, next to
the floor (a copy into memory pinned long before):

- pageable: a device-to-host copy straight into a shared mapping of a new tmpfs file (the
  driver stages it), then again into the same, now populated, file;
- register: ``cudaHostRegister`` of the populated mapping, the copy, ``cudaHostUnregister``;
- staged: a pinned ring of 256 MiB buffers, copied on into the file by worker threads.

Prints a markdown table. On a GPU machine: ``python bench/host_copy_probe.py [--gb 8 20]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def timed(fn) -> float:  # noqa: ANN001
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def file_view(path: str, size: int):  # noqa: ANN201
    import torch

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    return mm, arr, torch.from_numpy(arr)


def staged(src, dst_arr, threads: int, chunk: int = 256 << 20) -> None:  # noqa: ANN001
    """Device -> pinned ring -> file, the ring refilled while workers copy it on."""
    import torch

    ring = [torch.empty(chunk, dtype=torch.uint8).pin_memory() for _ in range(threads * 2)]
    events = [torch.cuda.Event() for _ in ring]
    stream = torch.cuda.Stream()
    free = [threading.Event() for _ in ring]
    for e in free:
        e.set()
    total = src.numel()

    def drain(i: int, off: int, n: int) -> None:
        events[i].synchronize()
        np.copyto(dst_arr[off:off + n], ring[i].numpy()[:n])
        free[i].set()

    with ThreadPoolExecutor(threads) as pool:
        futures = []
        for k, off in enumerate(range(0, total, chunk)):
            i = k % len(ring)
            free[i].wait()
            free[i].clear()
            n = min(chunk, total - off)
            with torch.cuda.stream(stream):
                ring[i][:n].copy_(src[off:off + n], non_blocking=True)
                events[i].record(stream)
            futures.append(pool.submit(drain, i, off, n))
        for f in futures:
            f.result()


def measure(gb: float, threads: int) -> dict:
    import torch

    size = int(gb * 10**9) // (2 << 20) * (2 << 20)
    x = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    out: dict = {"gb": gb}
    pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
    out["floor"] = timed(lambda: pinned.copy_(x))
    pinned = None
    shm = os.environ.get("SHM", "/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm) as d:
        path = os.path.join(d, "segments")
        mm, arr, view = file_view(path, size)
        out["pageable, new file"] = timed(lambda: view.copy_(x))
        out["pageable, populated"] = timed(lambda: view.copy_(x))
        cudart = torch.cuda.cudart()
        ptr = arr.ctypes.data
        t0 = time.perf_counter()
        assert int(cudart.cudaHostRegister(ptr, size, 0)) == 0
        out["register"] = time.perf_counter() - t0
        out["copy, registered"] = timed(lambda: view.copy_(x, non_blocking=True))
        t0 = time.perf_counter()
        assert int(cudart.cudaHostUnregister(ptr)) == 0
        out["unregister"] = time.perf_counter() - t0
        out["staged, populated"] = timed(lambda: staged(x, arr, threads))
        ok = bool(torch.equal(view[:: 1 << 20].cuda(), x[:: 1 << 20]))
        view = arr = None
        mm.close()
        path2 = os.path.join(d, "segments2")
        mm, arr, view = file_view(path2, size)
        out["staged, new file"] = timed(lambda: staged(x, arr, threads))
        ok = ok and bool(torch.equal(view[:: 1 << 20].cuda(), x[:: 1 << 20]))
        view = arr = None
        mm.close()
    out["ok"] = ok
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, nargs="*", default=[8, 20])
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args()
    rows = [measure(gb, args.threads) for gb in args.gb]
    cols = [k for k in rows[0] if k not in ("gb", "ok")]
    print("| GB | " + " | ".join(f"{c} s" for c in cols) + " | bytes checked |")
    print("|---" * (len(cols) + 2) + "|")
    for r in rows:
        print(f"| {r['gb']:g} | " + " | ".join(f"{r[c]:.3f}" for c in cols) +
              f" | {'yes' if r['ok'] else 'NO'} |")


if __name__ == "__main__":
    main()
