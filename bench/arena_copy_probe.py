"""Issues 27 and 33: how fast the VMM allocator's segments go into an arena file and come
back (vmm_arena.c, copy_pieces: pieces of 64 MiB, each copied 4 MiB at a time through the
copying threads' pinned bounce buffers), without a server, on one card or several.

Tensors of ``--gb`` GB in all are spread over ``--gpus`` cards (bf16, random), and, with two
cards or more, a tensor is copied between cards first, as PyTorch's ``.to()`` between cards
does (it enables peer access). Then, ``--rounds`` times: the segments into a new file, back,
into the same file again, back; every tensor's digest is checked after each wake. Prints a
markdown row of medians and the parts of the last round. On a GPU machine, with the arena's
kind of tmpfs (``mount -t tmpfs -o size=100g,huge=within_size none /mnt/ha``):
``python bench/arena_copy_probe.py --gb 24 --gpus 2 --dir /mnt/ha``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

GB = 10**9
STEPS = ("new file", "back from it", "same file", "back again")


def child(gb: float, gpus: int, rounds: int, directory: str) -> None:
    from infinijup.gpu import vmm

    vmm.install()
    import hashlib

    import torch

    per = int(gb * GB / gpus) // 2
    tensors = []
    for card in range(gpus):
        g = torch.Generator(device=f"cuda:{card}").manual_seed(card)
        tensors.append(torch.randn(per, dtype=torch.bfloat16, device=f"cuda:{card}", generator=g))
    if gpus > 1:
        tensors.append(tensors[0][: 1 << 20].to("cuda:1"))

    def digest() -> str:
        h = hashlib.sha256()
        for t in tensors:
            h.update(t[:: 1 << 12].float().cpu().numpy().tobytes())
        return h.hexdigest()

    before = digest()
    for card in range(gpus):
        torch.cuda.synchronize(card)
    took: dict[str, list[float]] = {s: [] for s in STEPS}
    parts: dict[str, dict] = {}
    moved = 0
    for r in range(rounds):
        path = os.path.join(directory, f"arena-{r}")
        for out, back in ((STEPS[0], STEPS[1]), (STEPS[2], STEPS[3])):
            t0 = time.perf_counter()
            moved = vmm.sleep_into(path)
            took[out].append(time.perf_counter() - t0)
            parts[out] = vmm.timings()
            t0 = time.perf_counter()
            vmm.wake_from(path)
            took[back].append(time.perf_counter() - t0)
            parts[back] = vmm.timings()
            if digest() != before:
                raise SystemExit(f"{out}: contents changed")
        os.unlink(path)
    print("| GB moved | cards | into a new file s | back s | into the same file s | back s |")
    print("|---|---|---|---|---|---|")
    print(f"| {moved / GB:.1f} | {gpus} | "
          + " | ".join(f"{statistics.median(took[s]):.2f}" for s in STEPS) + " |")
    print(f"\nparts of the last round ({' / '.join(vmm.TIMING_KEYS)}; all but the wait summed "
          "over the copying threads):")
    for step in STEPS:
        print(f"- {step}: " + " / ".join(f"{v:.2f}" for v in parts[step].values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=24)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm", help="where the arena files go (a tmpfs)")
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            child(args.gb, args.gpus, args.rounds, d)
        return
    cmd = [sys.executable, __file__, "--child", "--gb", str(args.gb), "--gpus", str(args.gpus),
           "--rounds", str(args.rounds), "--dir", args.dir]
    print(f"{args.gb} GB over {args.gpus} card(s), {args.rounds} rounds, files in {args.dir}")
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
