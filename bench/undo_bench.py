"""Undo of a kernel changed since its last snapshot, to the first answered cell, against a
restore of the same snapshot (issue 30's aim: within 1.5x), through a real `jupyter server`,
the helper and CRIU, the ways side by side in one run (serverext/undo.py): the kernel left is
set aside and stored behind the undo (the default where it can be); dumped first and stored
behind (``undo_sets_aside`` off: as on the GPU hosts, whose helper has no PID namespaces);
stored first (``undo_stores_behind`` off too: the way before).

Per working set (``--mib``), one server per way, each with its own helper (so its own hot
tier), its own store and a kernel holding that many MiB of random numbers (``--gpu``: a CUDA
tensor of that many MiB beside 64 MiB of numbers), snapshotted by hand. Then ``--runs``
times, in turn on each server: a quick cell changes the kernel (no snapshot of it); undo,
timed to its first answered cell; redo (it waits for the state left, and goes back to it); a
restore of the undo's snapshot, timed the same way; a restore back. Printed: each run's
times (with ``INFINIJUP_BENCH_VERBOSE=1`` the phases), then per working set and way the
medians and the ratio of undo to restore.

    python bench/undo_bench.py [--mib 256 2048] [--runs 3] [--ways aside dumped stored] [--gpu]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "helper"), str(ROOT / "tests" / "reliability"),
                str(ROOT / "bench")]
from autosnap_bench import timed_post, verbose  # noqa: E402
from benchkit import HelperDaemon, helper_in_base, markdown_table  # noqa: E402
from reliakit import ServerProcess  # noqa: E402
from wake_bench import run_cell  # noqa: E402

WAYS = {"aside": ("set aside", {}),
        "dumped": ("dumped first", {"undo_sets_aside": False}),
        "stored": ("stored first", {"undo_sets_aside": False, "undo_stores_behind": False})}


async def undo_once(server: ServerProcess, kernel_id: str, ws, i: int) -> tuple[float, float]:
    """One changed kernel's undo, and a restore of the same snapshot, to the first answer."""
    await run_cell(ws, f"changed = {i}")  # quick: no snapshot of it
    t0 = time.perf_counter()
    moved = timed_post(server, "undo", {"kernel_id": kernel_id})
    await run_cell(ws, "1")
    undo_s = time.perf_counter() - t0
    verbose("undo", moved)
    back = timed_post(server, "redo", {"kernel_id": kernel_id})  # waits for the state left
    here = moved["from"] or back["commit"]
    await run_cell(ws, "1")
    t0 = time.perf_counter()
    again = timed_post(server, "restore", {"kernel_id": kernel_id, "commit": moved["commit"]})
    await run_cell(ws, "1")
    restore_s = time.perf_counter() - t0
    verbose("restore", again)
    timed_post(server, "restore", {"kernel_id": kernel_id, "commit": here})
    await run_cell(ws, "1")
    return undo_s, restore_s


async def main_async(args) -> None:  # noqa: ANN001
    rows = []
    with helper_in_base() as (base, first_helper):
        helpers = [first_helper]
        try:
            for n in range(1, len(args.ways)):  # a hot tier of each way's own
                (base / f"helper-{n}").mkdir()
                helpers.append(HelperDaemon(base / f"helper-{n}"))
                helpers[-1].start()
            await ways(args, base, helpers, rows)
        finally:
            for helper in helpers[1:]:
                helper.stop()
    print(markdown_table(rows, [("set", "working set"), ("way", "the state left"),
                                ("undo", "undo of a changed kernel, to first cell"),
                                ("restore", "restore of the same, to first cell"),
                                ("ratio", "undo / restore (aim 1.5x)"), ("runs", "runs")]))


def fill(mib: int, gpu: bool) -> str:
    if not gpu:
        return f"import numpy as np\ndata = np.random.default_rng(7).random({mib * 2**20 // 8})"
    return ("import numpy as np, torch\n"
            f"data = np.random.default_rng(7).random({64 * 2**20 // 8})\n"
            "g = torch.Generator(device='cuda').manual_seed(7)\n"
            f"t = torch.rand(({mib * 2**20 // 4},), device='cuda', generator=g)\n"
            "torch.cuda.synchronize()")


async def ways(args, base: Path, helpers: list, rows: list[dict]) -> None:  # noqa: ANN001
    chosen = [WAYS[w] for w in args.ways]
    for mib in args.mib:
        servers, kernels = [], []
        try:
            for n, (_way, settings) in enumerate(chosen):
                server = ServerProcess(base / f"server-{mib}-{n}", helpers[n].socket_path,
                                       str(base / f"store-{mib}-{n}"), base / "notebooks",
                                       manager_config=settings)
                server.start()
                servers.append(server)
                kernel_id = server.open_session(f"bench-undo-{uuid.uuid4().hex[:6]}.ipynb")
                ws = await server.websocket(kernel_id)
                await run_cell(ws, fill(mib, args.gpu))
                code, body = server.request("POST", "/infinijup/snapshot",
                                            {"kernel_id": kernel_id})
                assert code == 201, body
                kernels.append((kernel_id, ws))
            times: list[list[tuple[float, float]]] = [[] for _ in chosen]
            for r in range(args.runs):
                for n, (way, _) in enumerate(chosen):
                    kernel_id, ws = kernels[n]
                    undo_s, restore_s = await undo_once(servers[n], kernel_id, ws, r)
                    times[n].append((undo_s, restore_s))
                    print(f"{mib} MiB, run {r + 1}, {way}: undo {undo_s:.2f} s, restore "
                          f"{restore_s:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
            for n, (way, _) in enumerate(chosen):
                undo = statistics.median(u for u, _ in times[n])
                restore = statistics.median(r for _, r in times[n])
                rows.append({"set": f"{mib} MiB{' GPU' if args.gpu else ''}", "way": way,
                             "undo": f"{undo:.2f} s", "restore": f"{restore:.2f} s",
                             "ratio": f"{undo / restore:.2f}x", "runs": args.runs})
        finally:
            for _kernel_id, ws in kernels:
                ws.close()
            for n, server in enumerate(servers):
                server.stop()
                shutil.rmtree(base / f"store-{mib}-{n}", ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, nargs="*", default=[256, 2048])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ways", nargs="*", choices=sorted(WAYS), default=list(WAYS))
    p.add_argument("--gpu", action="store_true", help="the working set as a CUDA tensor")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
