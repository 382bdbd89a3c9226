"""Issue 13: what a first snapshot's arena pages cost, by kind of host memory.

The first snapshot of a kernel writes its GPU segments into a new tmpfs file, and the page
allocations of that file (about 4.5 GB/s on the GPU hosts with 4 KiB pages) bound the way out.
For each directory given (a tmpfs mounted with ``huge=never``, such as /dev/shm, and one with
``huge=within_size`` or ``always``) and for anonymous memory, this measures, in one process:

- populate: ``MADV_POPULATE_WRITE`` of a new file's shared mapping, by N threads;
- register / unregister: ``cudaHostRegister`` of the populated mapping;
- D2H / H2D: a copy of a GPU tensor into the registered mapping and back;
- huge: how much of the mapping the kernel backed with 2 MiB pages (from /proc/self/smaps).

Prints a markdown table. On a GPU machine: ``python bench/arena_pages_probe.py --gb 10 DIR...``.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import threading
import time

MADV_POPULATE_WRITE = 23
MADV_HUGEPAGE = 14
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(base: int, size: int, threads: int, piece: int = 64 << 20) -> None:
    offsets = list(range(0, size, piece))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not offsets:
                    return
                off = offsets.pop()
            n = min(piece, size - off)
            if libc.madvise(base + off, n, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE")

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def huge_kib(base: int) -> int:
    """2 MiB-mapped KiB of the mapping that starts at ``base`` (smaps' *PmdMapped fields)."""
    want, found, total = f"{base:x}-", False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                found = line.startswith(want)
                continue
            if found and ("PmdMapped" in line or line.startswith("AnonHugePages")):
                total += int(line.split()[1])
    return total


def measure(place: str, size: int, threads: int) -> dict:
    import torch

    if place == "anonymous":
        mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        path = None
    else:
        path = os.path.join(place, f"probe-{os.getpid()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        os.close(fd)
    buf = (ctypes.c_char * size).from_buffer(mm)
    base = ctypes.addressof(buf)
    if place == "anonymous":
        libc.madvise(base, size, MADV_HUGEPAGE)
    out: dict = {"place": place}
    t0 = time.perf_counter()
    populate(base, size, threads)
    out["populate"] = time.perf_counter() - t0
    out["huge GB"] = huge_kib(base) * 1024 / 1e9
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    assert int(cudart.cudaHostRegister(base, size, 0)) == 0
    out["register"] = time.perf_counter() - t0
    host = torch.frombuffer(buf, dtype=torch.uint8)
    dev = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    out["D2H"] = time.perf_counter() - t0
    back = torch.empty_like(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    out["H2D"] = time.perf_counter() - t0
    out["ok"] = bool(torch.equal(back, dev))
    t0 = time.perf_counter()
    assert int(cudart.cudaHostUnregister(base)) == 0
    out["unregister"] = time.perf_counter() - t0
    del host, back, dev, buf
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    mm.close()
    if path:
        os.unlink(path)
    out["free"] = time.perf_counter() - t0
    return out


def soft_dirty() -> str:
    """Whether this kernel tracks soft-dirty pages (what CRIU's incremental dumps need)."""
    mm = mmap.mmap(-1, 4096)
    mm[0] = 1
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("4")
    except OSError as exc:
        return f"no ({exc})"

    def bit() -> int:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(addr // 4096 * 8)
            return int.from_bytes(f.read(8), "little") >> 55 & 1

    clean = bit()
    mm[0] = 2
    return "yes" if (clean, bit()) == (0, 1) else f"no (bit 55: {clean} after clear, {bit()} after a write)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("places", nargs="+", help="tmpfs directories, or 'anonymous'")
    p.add_argument("--gb", type=float, default=10)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    size = int(args.gb * 1e9) // (2 << 20) * (2 << 20)
    print(f"soft-dirty tracking: {soft_dirty()}")
    for name in ("enabled", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                print(f"transparent_hugepage/{name}: {f.read().strip()}")
        except OSError:
            pass
    cols = ["populate", "huge GB", "register", "D2H", "H2D", "unregister", "free"]
    print(f"\n{size / 1e9:.2f} GB per row, seconds unless named")
    print("| place | threads | " + " | ".join(cols) + " | bytes back equal |")
    print("|---" * (len(cols) + 3) + "|")
    for place in args.places:
        for threads in args.threads:
            r = measure(place, size, threads)
            print(f"| {place} | {threads} | " + " | ".join(f"{r[c]:.3f}" for c in cols) +
                  f" | {'yes' if r['ok'] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
