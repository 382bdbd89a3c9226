"""Undo on a GPU kernel (issue 30), through the real server: automatic snapshots of a kernel
holding CUDA tensors, three undos and a redo, each time the tensors' checksums and the CUDA RNG's
next draw as they were. Skipped with the reason where there is no GPU."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from kernelkit import needs_helper

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None

pytestmark = [
    needs_helper,
    pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)"),
    pytest.mark.timeout(900),
]

SLOW = "time.sleep(1.1)\n"
SUM = "int(t.double().sum().item())"


@pytest.fixture
def jp_server_config(jp_server_config):
    manager = {**jp_server_config["SnapshotManager"], "autosnapshot": True,
               "autosnapshot_after_s": 1.0, "autosnapshot_share": 1e-6}
    return {**jp_server_config, "SnapshotManager": manager}


async def test_undo_brings_back_tensors_and_the_cuda_rng(notebook):
    nb = notebook
    await nb.execute("import os, time, torch\n"
                     "os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'\n"
                     "torch.use_deterministic_algorithms(True)", timeout=300)
    await nb.execute(SLOW + "torch.cuda.manual_seed(5)\n"
                     "t = torch.randint(0, 255, (2**28,), dtype=torch.uint8, device='cuda')\n"
                     "torch.cuda.synchronize()", timeout=300)
    sums = [await nb.value(SUM)]
    draws = []
    for _ in range(2):  # each cell: the RNG's next draw, then t changes
        draws.append(await nb.value("torch.rand(4, device='cuda').tolist()"))
        await nb.execute(SLOW + "t += 1\ntorch.cuda.synchronize()", timeout=300)
        sums.append(await nb.value(SUM))

    async def post(what: str) -> dict:
        r = await nb.post(what, {"kernel_id": nb.kernel_id})
        assert r.code == 200, r.body
        return json.loads(r.body)

    await post("undo")  # back before the last `t += 1`
    assert await nb.value(SUM) == sums[1]
    await post("undo")
    assert await nb.value(SUM) == sums[0]
    # the CUDA RNG goes on from where it was: the same next draw as the first time
    assert await nb.value("torch.rand(4, device='cuda').tolist()") == draws[0]
    await post("redo")
    assert await nb.value(SUM) == sums[1]
    await post("redo")
    assert await nb.value(SUM) == sums[2]
