"""Switching one GPU between kernels whose memory together exceeds it (issue 27), through a
real `jupyter server` and the notebooks' websockets, as a user meets it.

Three kernels hold K1, K2 and K3 GB of CUDA tensors (default 24, 8, 56 on an 80 GB H100). K1 is
released first (its memory in host memory), then K3 is filled. Then cells go to K1, K3, K1,
each after a cell to K2, so that the other large kernel is the least recently active one on the
GPU: each must first make room (the server releases the idle kernel on the GPU, least recently
active first) and bring the woken kernel's memory back. Timed: the first answered cell (the switch) and, before it, K1's
release. Every tensor's checksum is checked after every switch.

Side by side in one run (``--paths``): ``arena`` (PyTorch's segments through the kernel's VMM
arena, the driver's checkpoint for the rest) and ``driver`` (the driver's checkpoint for all of
it). ``--arena-quota`` is the helper's per-user arena size (its default is 50% of the RAM; a
released kernel's segments wait there, so a switch is all-arena only when the kernel going out
and the one coming back fit together). Floors: bytes moved at 25 GB/s each way. Prints a
markdown table (one round: the second would start from another placement). Run as root with CRIU and the venv in place:

    python bench/switch_bench.py [--gb 24 8 56] [--paths arena driver] [--arena-quota 90%]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "helper"), str(ROOT / "tests" / "reliability"),
                str(ROOT / "bench")]
from benchkit import markdown_table  # noqa: E402
from helperkit import HelperDaemon, make_base  # noqa: E402
from reliakit import ServerProcess  # noqa: E402
from wake_bench import post, run_cell  # noqa: E402

FLOOR_GBPS = 25.0
FILL = ("import hashlib, torch\n"
        "g = torch.Generator(device='cuda').manual_seed({seed})\n"
        "t = torch.randint(0, 255, ({n},), dtype=torch.uint8, device='cuda', generator=g)\n"
        "digest = hashlib.sha256(t[::4096].cpu().numpy().tobytes()).hexdigest()")
CHECK = "assert hashlib.sha256(t[::4096].cpu().numpy().tobytes()).hexdigest() == digest"


async def one_path(server: ServerProcess, gb: list[float]) -> dict:
    names = ["K1", "K2", "K3"]
    ids = {k: server.open_session(f"switch-{k}.ipynb") for k in names}
    ws = {k: await server.websocket(ids[k]) for k in names}
    nbytes = {k: int(g * 1e9) for k, g in zip(names, gb, strict=True)}
    times: dict[str, float] = {}
    try:
        await run_cell(ws["K1"], FILL.format(seed=1, n=nbytes["K1"]))
        await run_cell(ws["K2"], FILL.format(seed=2, n=nbytes["K2"]))
        times["release K1"] = post(server, "release", ids["K1"])
        await run_cell(ws["K3"], FILL.format(seed=3, n=nbytes["K3"]))
        for label, k in (("to K1", "K1"), ("to K3", "K3"), ("to K1 again", "K1")):
            # K2 (small) is touched first, so the other large kernel is the least recently
            # active one on the GPU and gives way (jupyter_server's last_activity: 1 s grain)
            await run_cell(ws["K2"], CHECK)
            await asyncio.sleep(1.1)
            times[label] = await run_cell(ws[k], CHECK)
            await asyncio.sleep(1.1)
        for k in names:  # nobody lost a byte
            await run_cell(ws[k], CHECK)
    finally:
        for k in names:
            ws[k].close()
            server.request("DELETE", f"/api/kernels/{ids[k]}")
    return times


async def main_async(args) -> None:
    base = make_base()
    helper = HelperDaemon(base / "helper", extra_args=("--gpu-arena-quota", args.arena_quota))
    (base / "helper").mkdir()
    helper.__post_init__()
    helper.start()
    k1, _k2, k3 = args.gb
    floors = {"release K1": k1 / FLOOR_GBPS, "to K1": (k3 + k1) / FLOOR_GBPS,
              "to K3": (k1 + k3) / FLOOR_GBPS, "to K1 again": (k3 + k1) / FLOOR_GBPS}
    rows = [{"path": "floor", **{k: f"{v:.2f} s" for k, v in floors.items()}}]
    try:
        for n, path in enumerate(args.paths):
            server = ServerProcess(base / f"server-{n}", helper.socket_path,
                                   str(base / "store"), base / "notebooks",
                                   manager_config={"gpu_release_through_arena":
                                                   path != "driver"})
            server.start()
            try:
                t0 = time.perf_counter()
                r = await one_path(server, args.gb)
            finally:
                server.stop()
            rows.append({"path": path, **{k: f"{v:.2f} s" for k, v in r.items()}})
            print(rows[-1], f"({time.perf_counter() - t0:.0f} s in all)", flush=True)
    finally:
        helper.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(f"kernels {args.gb} GB, arena quota {args.arena_quota}, one round")
    print(markdown_table(rows, [("path", "path"), ("release K1", "release K1"),
                                ("to K1", "cell to K1 (K3 out, K1 in)"),
                                ("to K3", "cell to K3 (K1 out, K3 in)"),
                                ("to K1 again", "cell to K1 again")]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, nargs=3, default=[24.0, 8.0, 56.0])
    p.add_argument("--paths", nargs="*", default=["arena", "driver"],
                   choices=["arena", "driver"])
    p.add_argument("--arena-quota", default="50%")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
