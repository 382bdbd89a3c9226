"""Issue 13's first measurement: how fast PyTorch's CUDA memory leaves the GPU and comes back
through Infinijup's VMM allocator (infinijup/gpu/vmm.py), next to the physical floor (a pinned
device-to-host copy) and the CUDA driver's own checkpoint of the same process (what snapshots
and GPU release use today). Checks that every tensor keeps its address and bytes. Prints a
markdown table. On a GPU machine, with libinfinijup_vmm.so built:

    make infinijup/gpu/libinfinijup_vmm.so
    python bench/vmm_probe.py [--gb 2 8 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def child(gb: float) -> None:
    """One fresh process per size (the allocator must be in place before CUDA allocates)."""
    from infinijup.gpu import vmm

    vmm.install()
    import hashlib

    import torch

    n = int(gb * 10**9) // 2
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda", generator=g)
    w = torch.randn(4096, 4096, device="cuda", generator=g)
    ptrs = (x.data_ptr(), w.data_ptr())

    def digest() -> str:
        return hashlib.sha256(x[:: 1 << 16].float().cpu().numpy().tobytes() +
                              w.cpu().numpy().tobytes()).hexdigest()

    before = digest()
    torch.cuda.synchronize()
    pinned = torch.empty_like(x, device="cpu").pin_memory()
    t0 = time.perf_counter()
    pinned.copy_(x)
    torch.cuda.synchronize()
    floor = time.perf_counter() - t0
    del pinned
    vmm.keep_host(True)
    times = []
    for _ in range(2):  # the first sleep pins host memory; the second reuses it
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        moved = vmm.sleep()
        t_sleep = time.perf_counter() - t0
        freed = torch.cuda.mem_get_info()[0] - free0
        t0 = time.perf_counter()
        vmm.wake()
        times += [t_sleep, time.perf_counter() - t0]
        assert (x.data_ptr(), w.data_ptr()) == ptrs
        assert digest() == before, "contents changed"
        assert float((w @ w.T).trace()) > 0  # the GPU computes on the woken memory
    print(f"ROW {gb} {moved} {freed} {floor:.3f} " + " ".join(f"{t:.3f}" for t in times),
          flush=True)
    # the driver's checkpoint of the same process, for comparison (the parent does it)
    print(f"DRIVER {os.getpid()}", flush=True)
    sys.stdin.readline()
    assert digest() == before
    # the snapshot path: segments into a file of the hot tier (twice: a new file, then the
    # same file again), the driver checkpoint of what is left, the segments back from the file
    vmm.keep_host(False)
    import tempfile

    with tempfile.TemporaryDirectory(dir=os.environ.get("SHM", "/dev/shm")) as d:
        path = os.path.join(d, "segments")
        file_times = []
        for _ in range(2):
            t0 = time.perf_counter()
            vmm.sleep_into(path)
            file_times.append(time.perf_counter() - t0)
            print(f"DRIVER {os.getpid()}", flush=True)  # the parent: checkpoint, restore
            sys.stdin.readline()
            t0 = time.perf_counter()
            vmm.wake_from(path)
            file_times.append(time.perf_counter() - t0)
            assert (x.data_ptr(), w.data_ptr()) == ptrs
            assert digest() == before, "contents changed"
            assert float((w @ w.T).trace()) > 0
    print("FILE " + " ".join(f"{t:.3f}" for t in file_times), flush=True)


def driver_round(pid: int) -> tuple[float | None, float | None]:
    """The driver's lock + checkpoint of the process, then its restore + unlock: seconds."""
    from infinijup_helper import cuda_driver

    try:
        t0 = time.perf_counter()
        cuda_driver.suspend(pid, 30000)
        t_ckpt = time.perf_counter() - t0
        t0 = time.perf_counter()
        cuda_driver.resume(pid)
        return t_ckpt, time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - reported in the table
        print(f"driver checkpoint failed: {exc}", file=sys.stderr)
        return None, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, nargs="*", default=[2, 8, 20])
    p.add_argument("--child", type=float)
    args = p.parse_args()
    if args.child is not None:
        return child(args.child)
    rows, file_rows = [], []
    for gb in args.gb:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(gb)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        row = proc.stdout.readline().split()
        driver = proc.stdout.readline().split()
        t_drv = driver_round(int(driver[1]))[0] if driver[:1] == ["DRIVER"] else None
        proc.stdin.write("\n")
        proc.stdin.flush()
        small = []
        for _ in range(2):  # the process with its segments in the file: what is left
            line = proc.stdout.readline().split()
            small.append(driver_round(int(line[1])) if line[:1] == ["DRIVER"] else (None, None))
            proc.stdin.write("\n")
            proc.stdin.flush()
        files = [float(t) for t in proc.stdout.readline().split()[1:]]
        proc.wait()
        _, _, moved, freed, floor, *times = row
        rows.append((gb, int(moved), int(freed), float(floor), [float(t) for t in times], t_drv))
        file_rows.append((gb, files, small))
    print("| tensors | moved | GPU memory freed | pinned copy (floor) | 1st VMM sleep | wake "
          "| 2nd sleep (pinned kept) | wake | driver checkpoint (lock+checkpoint) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gb, moved, freed, floor, t, t_drv in rows:
        drv = f"{t_drv:.2f} s" if t_drv is not None else "n/a"
        print(f"| {gb:g} GB | {moved / 1e9:.2f} GB | {freed / 1e9:.2f} GB | {floor:.3f} s | "
              f"{t[0]:.3f} s | {t[1]:.3f} s | {t[2]:.3f} s | {t[3]:.3f} s | {drv} |")
    print()
    print("| tensors | into a new file | driver ckpt of the rest | driver restore | back from "
          "the file | into the same file again | driver ckpt | driver restore | back |")
    print("|---|---|---|---|---|---|---|---|---|")

    def fmt(t: float | None) -> str:
        return f"{t:.3f} s" if t is not None else "n/a"

    for gb, f, small in file_rows:
        cells = [f[0], *small[0], f[1], f[2], *small[1], f[3]] if len(f) == 4 else []
        print(f"| {gb:g} GB | " + " | ".join(fmt(t) for t in cells) + " |")


if __name__ == "__main__":
    main()
