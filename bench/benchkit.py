"""Shared by the benchmarks: a helper daemon, Infinijup kernels without a server, timing."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helper"))

from helperkit import CRIU, HelperDaemon, make_base  # noqa: E402,F401

GB = 10**9
MiB = 2**20


def use_infinijup_kernelspec() -> None:
    """Make the kernel name ``infinijup`` resolve to this Python, under our provisioner."""
    d = tempfile.mkdtemp(prefix="ijbench-spec-")
    spec = Path(d) / "kernels" / "infinijup"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "infinijup.kernel_magics.launch", "-f", "{connection_file}"],
        "display_name": "bench", "language": "python",
        "metadata": {"kernel_provisioner": {"provisioner_name": "infinijup-provisioner"}}}))
    os.environ["JUPYTER_PATH"] = d


def start_helper() -> HelperDaemon:
    daemon = HelperDaemon(make_base())
    daemon.start()
    os.environ["INFINIJUP_HELPER_SOCKET"] = daemon.socket_path
    return daemon


def execute(kc, code: str, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda m: None)
    assert reply["content"]["status"] == "ok", reply["content"]
    return time.perf_counter() - t0


def first_answer(kc, timeout: float = 120) -> float:
    """Seconds until an execute request is answered (its reply on shell)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        msg_id = kc.execute("1", silent=True, store_history=False)
        try:
            while True:
                reply = kc.get_shell_msg(timeout=1)
                if reply["parent_header"].get("msg_id") == msg_id:
                    return time.perf_counter() - t0
        except Exception:
            continue
    raise TimeoutError("no answer")


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    out = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for k, _ in columns:
            v = r.get(k, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
