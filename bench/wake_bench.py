"""Wake times of idle kernels (issue 14), through a real `jupyter server` and the notebook's
websocket, as a user meets them: the time of the first answered cell after

- a GPU release (VRAM moved to host memory in place; the cell brings it back), and
- a hibernation (snapshot to the store, process ended; the cell restores it),

for CPU kernels holding 0.1 / 1 / 4 GiB of array data and GPU kernels holding 2 / 8 / 20 GB of
VRAM. Also the time the hibernation and the release themselves take. CPU kernels are measured
once per restore mode, side by side in one run (``--restore whole lazy``: the server's
``lazy_restore`` off or on, issue 32); a lazy wake also gives the seconds until the kernel's
memory was all back (the helper's ``resident_s``, from the page daemon's start) and, with
``INFINIJUP_BENCH_VERBOSE=1``, where each wake's time went (the server logs its phases). GPU
kernels are measured once per release path, side by side in one run (``--paths``): ``arena``
(PyTorch's segments through the kernel's VMM arena, the driver's checkpoint for the rest: the
default) and ``driver`` (the driver's checkpoint for everything). Prints a markdown table
(medians of --repeat). Run as root with CRIU and the venv in place:

    python bench/wake_bench.py [--cpu-mib 100 1024 4096] [--gpu-gb 2 8 20] [--repeat 3]
                               [--paths arena driver] [--no-hibernate]
                               [--restore whole lazy] [--tier hot store]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "helper"), str(ROOT / "tests" / "reliability"),
                str(ROOT / "bench")]
from benchkit import helper_in_base, markdown_table  # noqa: E402
from reliakit import ServerProcess  # noqa: E402


async def run_cell(ws, code: str, timeout: float = 1200) -> float:
    """Send one execute request; seconds until its reply and its outputs are in."""
    msg_id = uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "bench",
                   "session": uuid.uuid4().hex, "date": "", "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": True,
                    "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
    t0 = time.perf_counter()
    reply = idle = False
    while not (reply and idle):
        raw = await asyncio.wait_for(ws.read_message(), timeout)
        if raw is None:
            raise RuntimeError("the websocket closed")
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "execute_reply":
            if msg["content"]["status"] != "ok":
                raise RuntimeError(f"cell failed: {msg['content']}")
            reply = True
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    return time.perf_counter() - t0


def post(server: ServerProcess, route: str, kernel_id: str) -> float:
    t0 = time.perf_counter()
    code, body = server.request("POST", f"/infinijup/{route}", {"kernel_id": kernel_id})
    if code != 200:
        raise RuntimeError(f"{route}: {code} {body}")
    took = time.perf_counter() - t0
    if os.environ.get("INFINIJUP_BENCH_VERBOSE"):  # the server's own account of the step
        print(f"{route} {took:.2f} s: {body}", flush=True)
    return took


def pages(server: ServerProcess, kernel_id: str) -> dict | None:
    code, body = server.request("GET", f"/infinijup/status?kernel_id={kernel_id}")
    if code != 200:
        raise RuntimeError(f"status: {code} {body}")
    return body.get("pages")


def resident_s(server: ServerProcess, kernel_id: str) -> float | None:
    """After a lazy wake: wait until the kernel's memory is all back (the next hibernation
    would otherwise read it through the page daemon); the daemon's seconds, or None (whole)."""
    deadline = time.monotonic() + 600  # hang guard
    while (now := pages(server, kernel_id)) is not None and now["state"] == "streaming":
        if time.monotonic() > deadline:
            raise RuntimeError(f"pages still streaming: {now}")
        time.sleep(0.02)
    if now is not None and now["state"] != "resident":
        raise RuntimeError(f"the pages failed: {now}")
    return now["resident_s"] if now is not None else None


WOKE = "infinijup: kernel "


def wake_phases(server: ServerProcess, kernel_id: str) -> list[dict]:
    """The restore phases of each wake of this kernel, from the server's log."""
    out = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        at = line.find(WOKE + kernel_id + " woke from ")
        if at >= 0:
            out.append(json.loads(line[line.index(": ", at + len(WOKE)) + 2:]))
    return out


async def one_size(server: ServerProcess, kind: str, nbytes: int, repeat: int,
                   hibernate: bool = True) -> dict:
    kernel_id = server.open_session(f"bench-{kind}-{nbytes}-{uuid.uuid4().hex[:6]}.ipynb")
    ws = await server.websocket(kernel_id)
    if kind == "cpu":
        fill = (f"import numpy as np\n"
                f"a = np.random.default_rng(0).integers(0, 255, {nbytes}, dtype=np.uint8)")
    else:
        fill = (f"import torch\ng = torch.Generator(device='cuda').manual_seed(0)\n"
                f"t = torch.randint(0, 255, ({nbytes},), dtype=torch.uint8, device='cuda', "
                f"generator=g)\ntorch.cuda.synchronize()")
    await run_cell(ws, fill)
    times: dict[str, list[float]] = {k: [] for k in
                                     ("release", "release_wake", "hibernate", "hibernate_wake",
                                      "resident")}
    for _ in range(repeat):
        if kind == "gpu":
            times["release"].append(post(server, "release", kernel_id))
            times["release_wake"].append(await run_cell(ws, "1"))
        if hibernate:
            times["hibernate"].append(post(server, "hibernate", kernel_id))
            times["hibernate_wake"].append(await run_cell(ws, "1"))
            if (back := resident_s(server, kernel_id)) is not None:
                times["resident"].append(back)
    ws.close()
    if os.environ.get("INFINIJUP_BENCH_VERBOSE"):
        for woke in wake_phases(server, kernel_id):
            print(f"wake: {json.dumps(woke)}", flush=True)
    server.request("DELETE", f"/api/kernels/{kernel_id}")
    return {k: statistics.median(v) if v else None for k, v in times.items()}


async def main_async(args) -> None:
    rows = []
    with helper_in_base() as (base, helper):
        runs = [("cpu", m * 2**20, f"CPU {m} MiB, {mode}, {tier}", None, mode, tier)
                for m in args.cpu_mib for tier in args.tier for mode in args.restore] + \
               [("gpu", int(g * 10**9), f"GPU {g} GB, {path}, {tier}", path, "whole", tier)
                for path in args.paths for g in args.gpu_gb for tier in args.tier]
        for n, (kind, nbytes, label, path, mode, tier) in enumerate(runs):
            # one server per release path and restore mode, the same helper for all
            server = ServerProcess(base / f"server-{n}", helper.socket_path,
                                   str(base / "store"), base / "notebooks",
                                   manager_config={"gpu_release_through_arena":
                                                   path != "driver",
                                                   "lazy_restore": mode == "lazy",
                                                   **({"hot_tier_bytes": 0}
                                                      if tier == "store" else {})})
            server.start()
            try:
                r = await one_size(server, kind, nbytes, args.repeat, not args.no_hibernate)
            finally:
                server.stop()
            rows.append({"kernel": label, **{k: "-" if v is None else f"{v:.2f} s"
                                             for k, v in r.items()}})
            print(rows[-1], flush=True)
    print(markdown_table(rows, [("kernel", "kernel"), ("release", "GPU release"),
                                ("release_wake", "first cell after release"),
                                ("hibernate", "hibernate (snapshot + end)"),
                                ("hibernate_wake", "first cell after hibernate"),
                                ("resident", "memory all back (lazy)")]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-mib", type=int, nargs="*", default=[100, 1024, 4096])
    p.add_argument("--gpu-gb", type=float, nargs="*", default=[])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--paths", nargs="*", default=["arena", "driver"],
                   choices=["arena", "driver"], help="GPU release paths to compare")
    p.add_argument("--no-hibernate", action="store_true", help="release and wake only")
    p.add_argument("--restore", nargs="*", default=["whole"], choices=["whole", "lazy"],
                   help="CPU kernels' restore modes to compare (the server's lazy_restore)")
    p.add_argument("--tier", nargs="*", default=["hot"], choices=["hot", "store"],
                   help="where a wake's images come from: the hot tier, or the store (the hot "
                   "tier off: a whole wake checks everything out, a lazy one leaves the page "
                   "files in the store, engine/store_pages.py)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
