"""Shared by the benchmarks: a helper daemon, Infinijup kernels without a server, timing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helper"))

from helperkit import CRIU, HelperDaemon, make_base  # noqa: E402,F401

GB = 10**9
MiB = 2**20


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only); False where that is not allowed."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_packs(store: Path) -> tuple[int, float]:
    """Every pack file of ``store`` read once, 8 threads, 8 MiB reads: (bytes, seconds)."""
    packs = [p for p in (store / "packs").rglob("*") if p.is_file()]

    def read(path: Path) -> None:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(read, packs))
    return sum(p.stat().st_size for p in packs), time.perf_counter() - t0


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


def start_helper(work_dir: str | None = None) -> HelperDaemon:
    """A helper daemon for this run; ``work_dir``: its work root (where CRIU writes the
    images and the hot tier lives), default inside its temp base on disk."""
    daemon = HelperDaemon(make_base())
    if work_dir is not None:
        daemon.work_dir = work_dir
    daemon.start()
    os.environ["INFINIJUP_HELPER_SOCKET"] = daemon.socket_path
    return daemon


@contextlib.contextmanager
def huge_tmpfs(size: str = "50%") -> Iterator[str]:
    """A tmpfs of its own mounted with 2 MiB pages (``huge=within_size``), as an admin could
    mount for the helper's work dir; unmounted and removed afterwards (root only)."""
    path = tempfile.mkdtemp(prefix="ijbench-work-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={size}", "tmpfs",
                    path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def helper_in_base(extra_args: tuple[str, ...] = ()) -> Iterator[tuple[Path, HelperDaemon]]:
    """A temp base with a helper daemon in ``<base>/helper``, both gone afterwards: for
    benchmarks that start servers of their own beside it (``reliakit.ServerProcess``)."""
    base = make_base()
    (base / "helper").mkdir()
    helper = HelperDaemon(base / "helper", extra_args=extra_args)
    helper.start()
    try:
        yield base, helper
    finally:
        helper.stop()
        shutil.rmtree(base, ignore_errors=True)


def start_server(base: Path, helper_socket: str, store: str, manager: dict | None = None):
    """A real ``jupyter server`` with Infinijup as a child process (the reliability tests'
    ServerProcess), its SnapshotManager configured with ``manager`` on top of the defaults."""
    sys.path.insert(0, str(REPO / "tests" / "reliability"))
    from reliakit import ServerProcess

    server = ServerProcess(base, helper_socket, store, base / "notebooks")
    config = base / "config" / "jupyter_server_config.json"
    data = json.loads(config.read_text())
    data["SnapshotManager"].update(manager or {})
    config.write_text(json.dumps(data))
    server.start()
    return server


def kernel_root(kernel_id: str) -> int:
    """The root of a server kernel's process tree (its init, or the kernel itself)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if any(f"kernel-{kernel_id}.json" in a for a in (proc.info["cmdline"] or [])):
            parent = proc.parent()
            if parent is not None and "nsinit" in " ".join(parent.cmdline()):
                return parent.pid  # the tree's init (nsinit)
            return proc.pid
    raise RuntimeError(f"no process for kernel {kernel_id}")


def tree_rss(root: int) -> int:
    import psutil

    procs = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
    return sum(p.memory_info().rss for p in procs)


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


def transposed_table(rows: list[dict], names: list[str], metrics: list[tuple[str, str]]) -> str:
    """A markdown table with one row per metric and one column per run."""
    out = ["| | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for key, label in metrics:
        cells = []
        for r in rows:
            v = r.get(key, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    out = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for k, _ in columns:
            v = r.get(k, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
