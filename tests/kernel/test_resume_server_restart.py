"""Resume after the Jupyter server is gone (issue 11): a real ``jupyter server`` process is
stopped (SIGTERM: it shuts its kernels down) or killed (SIGKILL: its kernel is orphaned), a new
server on the same store lists the notebook's snapshots as resumable and brings the state back
in a new kernel."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from kernelkit import needs_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from reliakit import ServerProcess, make_base  # noqa: E402

pytestmark = [needs_helper, pytest.mark.timeout(300)]

NB = "work.ipynb"
NEXT = "repr((x, random.random(), float(rng.random())))"


def _resume_and_read(server: ServerProcess, commit: str) -> str:
    code, hist = server.request("GET", f"/infinijup/history?path={NB}")
    assert code == 200, hist
    assert {c["id"]: c["resumable"] for c in hist["commits"]}[commit] is True, hist
    code, body = server.request("POST", "/infinijup/resume", {"path": NB, "commit": commit})
    assert code == 200, body
    kernel = server.kernel_client(body["kernel_id"])
    try:
        value = kernel.evaluate(v=NEXT)["v"]
        # %snapshot from the resumed kernel reaches *this* server (its URL and the kernel's
        # signature, not the old server's token) and lands on the resumed commit.
        message = f"after resume on {server.port}"
        kernel.execute(f"%snapshot -w -m '{message}'", timeout=120)
        code, hist = server.request("GET", f"/infinijup/history?path={NB}")
        assert code == 200, hist
        mine = [c for c in hist["commits"] if c.get("message") == message]
        assert len(mine) == 1 and mine[0]["parents"] == [commit], hist
        return value
    finally:
        kernel.kc.stop_channels()


def test_resume_after_server_stop_and_kill(helper_daemon):
    from infinijup.helper_client import HelperClient

    base = make_base()
    store = str(base / "store")
    notebooks = base / "notebooks"
    servers = [ServerProcess(base / n, helper_daemon.socket_path, store, notebooks)
               for n in ("a", "b", "c")]
    orphans: list[int] = []
    try:
        first = servers[0]
        first.start()
        kernel_id = first.open_session(NB)
        kernel = first.kernel_client(kernel_id)
        kernel.execute("import random, numpy as np; x = 5; random.seed(9); "
                       "rng = np.random.default_rng(11)")
        code, snap = first.request("POST", "/infinijup/snapshot", {"kernel_id": kernel_id})
        assert code == 201, snap
        expected = kernel.evaluate(v=NEXT)["v"]
        kernel.kc.stop_channels()
        first.stop()  # SIGTERM: the server shuts its kernel down

        second = servers[1]
        second.start()
        assert _resume_and_read(second, snap["commit"]) == expected
        code, kernels = second.request("GET", "/api/kernels")
        orphans = [int(p) for p in _kernel_roots(second, kernels)]
        second.sigkill()  # its kernel runs on, holding its endpoints
        helper = HelperClient(helper_daemon.socket_path)
        if not helper.hello().features.get("pid_namespace"):
            # Without PID namespaces (CUDA machines) the orphan holds the very pids the
            # snapshot needs: it has to be ended first (docs/guide.md, "Resume anywhere").
            for pid in orphans:
                helper.kill(pid)

        third = servers[2]
        third.start()
        assert _resume_and_read(third, snap["commit"]) == expected
    finally:
        for server in servers:
            server.stop()
        helper = HelperClient(helper_daemon.socket_path)
        for pid in orphans:
            try:
                helper.kill(pid)
            except Exception:
                pass
        shutil.rmtree(base, ignore_errors=True)


def _kernel_roots(server: ServerProcess, kernels: list[dict]) -> list[int]:
    """Host pids of the kernel trees the server runs (the helper's view of its kernels)."""
    import json

    roots = []
    for k in kernels:
        conn = json.loads((server.runtime / f"kernel-{k['id']}.json").read_text())
        roots.append(_listener_root(f"{conn['ip']}-{conn['shell_port']}",
                                    server.env["INFINIJUP_HELPER_SOCKET"]))
    return roots


def _listener_root(shell: str, socket_path: str) -> int:
    from infinijup.engine.orphans import find_restored_tree

    pid = find_restored_tree(shell, socket_path=socket_path)
    assert pid is not None, f"no kernel tree listens on {shell}"
    return pid
