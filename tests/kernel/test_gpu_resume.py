"""Resume anywhere on a GPU (issue 11): a kernel holding CUDA tensors and a CUDA generator is
snapshotted, its Jupyter server stopped, and a new server resumes the snapshot in a new kernel:
tensors and the CUDA RNG continue exactly. Runs on an NVIDIA GPU machine; skipped elsewhere."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from kernelkit import needs_helper
from test_gpu_kernel import HAS_GPU, TENSORS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from reliakit import ServerProcess, make_base  # noqa: E402

pytestmark = [
    needs_helper,
    pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)"),
    pytest.mark.timeout(600),
]

NB = "gpu.ipynb"
NEXT = "repr((digest(t), digest(torch.randn(1024, device='cuda', generator=g))))"


def test_gpu_kernel_resumes_after_server_restart(helper_daemon):
    base = make_base()
    store = str(base / "store")
    first = ServerProcess(base / "a", helper_daemon.socket_path, store, base / "notebooks")
    second = ServerProcess(base / "b", helper_daemon.socket_path, store, base / "notebooks")
    try:
        first.start()
        kernel_id = first.open_session(NB)
        kernel = first.kernel_client(kernel_id)
        kernel.execute(TENSORS, timeout=300)
        code, snap = first.request("POST", "/infinijup/snapshot", {"kernel_id": kernel_id},
                                   timeout=600)
        assert code == 201, snap
        expected = kernel.evaluate(v=NEXT)["v"]
        kernel.kc.stop_channels()
        first.stop()  # its kernel is shut down: its pids and GPU memory are free again

        second.start()
        code, hist = second.request("GET", f"/infinijup/history?path={NB}")
        assert code == 200 and hist["commits"][0]["resumable"], hist
        code, body = second.request("POST", "/infinijup/resume",
                                    {"path": NB, "commit": snap["commit"]}, timeout=600)
        assert code == 200, body
        resumed = second.kernel_client(body["kernel_id"])
        assert resumed.evaluate(v=NEXT)["v"] == expected
        resumed.kc.stop_channels()
    finally:
        second.stop()
        first.stop()
        shutil.rmtree(base, ignore_errors=True)
