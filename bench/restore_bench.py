"""Restore in place and resume into a new kernel, to the first answered cell, as issue 32's
aims state them: a kernel of 3 GiB or 16 GiB against one of 256 MiB, with the images in the hot
tier and in the store only, through a real `jupyter server`, the helper and CRIU.

One server per tier (``--tier hot store``; "store": the hot tier off, so a restore reads the
store: page files of 1 GiB or more are served from it lazily, smaller ones checked out), the
server's ``lazy_restore`` on (``--whole``: off, for the row to compare with). On each server,
one notebook per size (``--mib``), its kernel holding that many MiB of random numbers, one
snapshot taken by hand. Then ``--runs`` times, the sizes in turn: a restore of that snapshot in
place (timed from the request to the reply of the cell ``1`` sent after it), the memory let
come back, then a resume of it into a new kernel in a copy of the notebook (the request, the
new kernel's websocket opened, the cell's reply), its memory let come back and the new kernel
shut down. Printed: each run, then the medians and each size's ratio to the first size.

    python bench/restore_bench.py [--mib 256 3072] [--tier hot store] [--runs 3] [--whole]
                                  [--pid-namespace always]

``--pid-namespace always`` gives the helper's kernels PID namespaces on a machine with CUDA
(where the helper leaves them off): a resume beside the running kernel, and a kernel kept
aside, need them.

``INFINIJUP_BENCH_VERBOSE=1`` prints each restore's phases as the server reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "helper"), str(ROOT / "tests" / "reliability"),
                str(ROOT / "bench")]
from autosnap_bench import timed_post, verbose  # noqa: E402
from benchkit import helper_in_base, markdown_table  # noqa: E402
from reliakit import ServerProcess  # noqa: E402
from wake_bench import resident_s, run_cell  # noqa: E402


def fill(mib: int) -> str:
    return f"import numpy as np\ndata = np.random.default_rng(7).random({mib * 2**20 // 8})"


async def restore_once(server: ServerProcess, kernel_id: str, ws, commit: str) -> float:
    t0 = time.perf_counter()
    got = timed_post(server, "restore", {"kernel_id": kernel_id, "commit": commit})
    await run_cell(ws, "1")
    took = time.perf_counter() - t0
    verbose("restore", got)
    resident_s(server, kernel_id)
    return took


async def resume_once(server: ServerProcess, path: str, commit: str) -> float:
    t0 = time.perf_counter()
    got = timed_post(server, "resume", {"path": path, "commit": commit, "new_notebook": True})
    kernel_id = got["kernel_id"]
    ws = await server.websocket(kernel_id)
    await run_cell(ws, "1")
    took = time.perf_counter() - t0
    verbose("resume", got)
    resident_s(server, kernel_id)
    ws.close()
    code, body = server.request("DELETE", f"/api/sessions/{got['session_id']}")
    if code != 204:
        raise RuntimeError(f"ending the resumed kernel: {code} {body}")
    return took


async def one_tier(args, base: Path, helper, tier: str, rows: list[dict]) -> None:  # noqa: ANN001
    settings = {"lazy_restore": not args.whole, **({"hot_tier_bytes": 0} if tier == "store" else {})}
    server = ServerProcess(base / f"server-{tier}", helper.socket_path, str(base / f"store-{tier}"),
                           base / f"notebooks-{tier}", manager_config=settings)
    server.start()
    kernels = {}
    try:
        for mib in args.mib:
            path = f"bench-restore-{mib}-{uuid.uuid4().hex[:6]}.ipynb"
            kernel_id = server.open_session(path)
            ws = await server.websocket(kernel_id)
            await run_cell(ws, fill(mib))
            code, body = server.request("POST", "/infinijup/snapshot", {"kernel_id": kernel_id})
            assert code == 201, body
            kernels[mib] = (path, kernel_id, ws, body["commit"])
        times: dict[int, dict[str, list[float]]] = {m: {"restore": [], "resume": []}
                                                    for m in args.mib}
        for r in range(args.runs):
            for mib in args.mib:
                path, kernel_id, ws, commit = kernels[mib]
                times[mib]["restore"].append(await restore_once(server, kernel_id, ws, commit))
                times[mib]["resume"].append(await resume_once(server, path, commit))
                print(f"{tier}, {mib} MiB, run {r + 1}: restore {times[mib]['restore'][-1]:.2f} s, "
                      f"resume {times[mib]['resume'][-1]:.2f} s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
        small = args.mib[0]
        first = {k: statistics.median(v) for k, v in times[small].items()}
        for mib in args.mib:
            med = {k: statistics.median(v) for k, v in times[mib].items()}
            rows.append({"kernel": f"{mib} MiB", "tier": tier,
                         "restore": f"{med['restore']:.2f} s",
                         "restore_x": f"{med['restore'] / first['restore']:.2f}x",
                         "resume": f"{med['resume']:.2f} s",
                         "resume_x": f"{med['resume'] / first['resume']:.2f}x"})
    finally:
        for _path, _kernel_id, ws, _commit in kernels.values():
            ws.close()
        server.stop()


async def main_async(args) -> None:  # noqa: ANN001
    rows: list[dict] = []
    extra = ("--pid-namespace", args.pid_namespace) if args.pid_namespace else ()
    with helper_in_base(extra) as (base, helper):
        for tier in args.tier:
            await one_tier(args, base, helper, tier, rows)
    way = "whole" if args.whole else "lazy"
    print(f"\nrestore and resume to the first answered cell ({way}), medians of {args.runs}, "
          f"{os.cpu_count()} CPUs\n")
    small = f"{args.mib[0]} MiB"
    print(markdown_table(rows, [("kernel", "kernel"), ("tier", "images from"),
                                ("restore", "restore in place"),
                                ("restore_x", f"against {small}"),
                                ("resume", "resume into a new kernel"),
                                ("resume_x", f"against {small}")]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, nargs="+", default=[256, 3072])
    p.add_argument("--tier", nargs="+", choices=["hot", "store"], default=["hot", "store"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--whole", action="store_true", help="the server's lazy_restore off")
    p.add_argument("--pid-namespace", choices=["auto", "always", "never"],
                   help="the helper's --pid-namespace (default: its own, auto)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
