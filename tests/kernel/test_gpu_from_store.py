"""GPU kernels restored from the store where no running kernel is replaced: the GPU segments
file is checked out behind the rest of the images while CRIU and the driver restore the
process (engine/file_behind.py), and the kernel takes it once it is all there. A wake from
hibernation and a resume into a new kernel, the hot tier off so the images come from the
store; a damaged chunk of the segments ends the resumed kernel with the reason. Runs on an
NVIDIA GPU machine; skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os

import pytest
from kernelkit import Notebook, needs_helper
from test_gpu_kernel import HAS_GPU, TENSORS
from test_resume import attach, kernel_ids, resume

from infinijup.store.layout import pack_files

pytestmark = [
    needs_helper,
    pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)"),
    pytest.mark.timeout(600),
]

HELD = ("repr((digest(t), digest(ballast), "
        "hashlib.sha256(g.get_state().numpy().tobytes()).hexdigest()))")
NEXT = "repr((digest(t), digest(ballast), digest(torch.randn(1024, device='cuda', generator=g))))"


def _from_store(jp_serverapp):  # noqa: ANN001, ANN202
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.hot_tier_bytes = 0  # every restore reads the store
    return manager


async def _state(nb: Notebook) -> str:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)["state"]


async def test_a_hibernated_gpu_kernel_wakes_from_the_store(notebook, jp_serverapp):
    _from_store(jp_serverapp)
    nb = notebook
    await nb.execute(TENSORS, timeout=300)
    held = await nb.value(HELD)
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert await _state(nb) == "hibernated"
    assert await nb.value(HELD) == held  # its first cell woke it: every byte, the RNG's state
    assert await _state(nb) == "running"
    assert await nb.value("float((t @ t).trace()) == float((t @ t).trace())")  # it computes


async def test_a_gpu_snapshot_resumes_from_the_store_with_its_segments_behind(
        notebook, jp_serverapp):
    manager = _from_store(jp_serverapp)
    await notebook.execute(TENSORS, timeout=300)
    snap = await notebook.snapshot(message="gpu, from the store")
    expected = await notebook.value(NEXT)
    # its pids and GPU memory free again (this host's helper has no PID namespaces)
    await notebook.fetch("api", "kernels", notebook.kernel_id, method="DELETE")
    before = await kernel_ids(notebook)
    code, body = await resume(notebook, snap["commit"])
    assert code == 200, body
    assert body["phases"]["images"] == "store" and body["phases"]["behind_s"] > 0, body
    nb = await attach(Notebook(notebook.fetch, notebook.ws_fetch, notebook.path),
                      body["kernel_id"])
    try:
        assert await nb.value(NEXT) == expected
    finally:
        await nb.close()  # (it shuts the resumed kernel down)

    # a damaged chunk of the segments: the resumed kernel is ended, the reason said
    repo = manager.repo()
    tree = repo.get_tree(repo.get_commit(snap["commit"]).tree)
    entry = next(e for e in tree if e.name == "gpu-segments")
    locs = repo.index.lookup_many(repo.get_blob_chunks(entry.id)[1])
    loc = max(locs.values(), key=lambda loc: loc.length)
    with open(pack_files(repo)[loc.pack], "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    code, body = await resume(notebook, snap["commit"])
    assert code == 500 and body["reason"] == "checksum_mismatch", body
    assert "gpu-segments" in body["message"], body
    assert await kernel_ids(notebook) == before  # nothing started is left running
