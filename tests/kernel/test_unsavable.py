"""A kernel holding a live NCCL communicator is refused before anything is frozen (issue 33).

Through the real server, helper and kernel: the snapshot (REST and ``%snapshot``) answers
422 ``live_nccl`` with what to do, no commit is made and the kernel runs on as it was; once
the group is destroyed, the same kernel snapshots. The communicator itself is a stand-in here
(``torch.distributed`` answering as a process group on NCCL does: this machine has no GPU and
no torch); the real one runs on the GPU machine (tests/kernel/test_gpu_multi.py).
"""

from __future__ import annotations

import json

from kernelkit import needs_helper

pytestmark = needs_helper

LIVE_GROUP = """
import sys, types
dist = types.ModuleType("torch.distributed")
group = {"live": True}
dist.is_available = lambda: True
dist.is_initialized = lambda: group["live"]
dist.get_backend = lambda group=None: "nccl"
sys.modules["torch.distributed"] = dist
weights = list(range(1000))
"""


async def test_a_live_nccl_group_is_refused_and_the_kernel_runs_on(notebook):
    nb = notebook
    await nb.execute(LIVE_GROUP)
    r = await nb.post("snapshot", {"kernel_id": nb.kernel_id})
    assert r.code == 422, r.body
    body = json.loads(r.body)
    assert body["reason"] == "live_nccl", body
    assert "destroy_process_group" in body["message"], body
    assert (await nb.history())["commits"] == []
    assert await nb.value("sum(weights)") == sum(range(1000))

    out = await nb.collect(nb.send_execute("%snapshot -m with-group\nafter = True"))
    assert out["reply"]["status"] == "error", out
    assert out["reply"]["traceback"][-1].endswith("(live_nccl)"), out
    assert (await nb.history())["commits"] == []

    await nb.execute("group['live'] = False")  # destroy_process_group()
    snap = await nb.snapshot(message="after the group")
    assert [c["id"] for c in (await nb.history())["commits"]] == [snap["commit"]]
    await nb.execute("weights.append(1)")
    await nb.restore(snap["commit"])
    assert await nb.value("len(weights)") == 1000
