"""Kernels on several GPUs (issue 33), the parts that run on the CPU: the topology the helper
reads from NVML, the restore plan that maps the saved cards onto this machine's (same model,
joined the same way) or refuses with the reason, and the blocks the VMM arena hashes per card.

NVML's answers are supplied (a machine of four H100s, two NVLink pairs joined by PCIe); the
real reads, restores and the NCCL refusal run on the GPU machine (tests/kernel/test_gpu_multi.py).
"""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest

from infinijup.errors import PreflightRefused
from infinijup.gpu import block_hash, restore_rules
from infinijup.gpu.fingerprint import Fingerprint, link_mismatches, remap
from infinijup.gpu.preflight import GpuReport
from infinijup_helper import cuda_preflight

H100 = "NVIDIA H100 80GB HBM3"
NVLINK_PAIRS = ({0, 1}, {2, 3})  # cards 0-1 and 2-3 joined by NVLink, the rest by PCIe


def four_gpus(uuids=("GPU-a", "GPU-b", "GPU-c", "GPU-d"), nvlink=NVLINK_PAIRS):
    m = types.ModuleType("pynvml")
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(uuids)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetMigMode = lambda h: (0, 0)
    m.nvmlDeviceGetUUID = lambda h: uuids[h]
    m.nvmlDeviceGetName = lambda h: H100
    m.nvmlDeviceGetPciInfo = lambda h: SimpleNamespace(busId=f"0000:{h:02x}:00.0")
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=80 * 2**30)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: []
    m.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    m.nvmlSystemGetCudaDriverVersion = lambda: 13000
    m.NVML_P2P_STATUS_OK = 0

    def p2p(a, b, index):
        assert isinstance(index, int)  # (nvidia-ml-py's own READ constant is a tuple)
        if index == cuda_preflight.P2P_NVLINK:
            return 0 if {a, b} in nvlink else 1
        return 0  # PCIe peer-to-peer between every pair

    m.nvmlDeviceGetP2PStatus = p2p
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 0 if {a, b} in nvlink else 40
    return m


def fingerprint(monkeypatch, **kw) -> Fingerprint:
    monkeypatch.setitem(sys.modules, "pynvml", four_gpus(**kw))
    report = cuda_preflight.read_nvml()
    return Fingerprint.from_json(json.loads(json.dumps(report.fingerprint)))


def test_the_helper_records_how_each_pair_is_joined(monkeypatch):
    fp = fingerprint(monkeypatch)
    kinds = {(k.a, k.b): (k.kind, k.path) for k in fp.links}
    assert kinds == {(0, 1): ("nvlink", "same board"), (2, 3): ("nvlink", "same board"),
                     (0, 2): ("pcie", "one NUMA node"), (0, 3): ("pcie", "one NUMA node"),
                     (1, 2): ("pcie", "one NUMA node"), (1, 3): ("pcie", "one NUMA node")}
    assert fp.link("GPU-b", "GPU-a") == "nvlink" and fp.link("GPU-a", "GPU-c") == "pcie"
    assert Fingerprint.from_json(fp.to_json()) == fp


def test_a_kernel_on_an_nvlink_pair_goes_onto_an_nvlink_pair(monkeypatch):
    """Saved on cards c and d (an NVLink pair) of machine A; machine B has other cards, its
    first free pair in order (e, f) is NVLink too: mapped in order. Were the order to pair c
    with a PCIe neighbour, the plan picks cards joined as they were."""
    saved = fingerprint(monkeypatch)
    here = fingerprint(monkeypatch, uuids=("GPU-e", "GPU-f", "GPU-g", "GPU-h"))
    pairs = dict(remap(saved, here, used=["GPU-c", "GPU-d"]))
    assert here.link(pairs["GPU-c"], pairs["GPU-d"]) == "nvlink"
    assert link_mismatches(saved, here, pairs, ["GPU-c", "GPU-d"]) == []
    # B's NVLink pairs are 0-3 and 1-2: in-order mapping (c->g, d->h) would join them by PCIe
    odd = fingerprint(monkeypatch, uuids=("GPU-e", "GPU-f", "GPU-g", "GPU-h"),
                      nvlink=({0, 3}, {1, 2}))
    pairs = dict(remap(saved, odd, used=["GPU-c", "GPU-d"]))
    assert odd.link(pairs["GPU-c"], pairs["GPU-d"]) == "nvlink", pairs
    assert sorted(pairs.values()) == ["GPU-e", "GPU-f", "GPU-g", "GPU-h"]  # a permutation


def test_cards_on_the_same_machine_stay_put(monkeypatch):
    fp = fingerprint(monkeypatch)
    assert remap(fp, fp, used=["GPU-a", "GPU-b"]) == [(u, u) for u in
                                                      ("GPU-a", "GPU-b", "GPU-c", "GPU-d")]


def plan(monkeypatch, saved: Fingerprint, here: Fingerprint, used: list[str], **kw):
    meta = {"gpu": {"fingerprint": saved.to_json(), "vram_bytes": {u: 1 << 30 for u in used}}}
    monkeypatch.setattr(restore_rules, "read_nvml",
                        lambda: GpuReport(fingerprint=here, processes=()))
    return restore_rules.plan_gpu_restore(meta, **kw)


def test_restore_refuses_cards_joined_otherwise_before_touching_anything(monkeypatch):
    """A machine whose every pair is PCIe only cannot give back the NVLink pair the kernel
    used: refused (422, gpu_topology) with both sides named; ``force`` tries anyway."""
    saved = fingerprint(monkeypatch)
    here = fingerprint(monkeypatch, uuids=("GPU-e", "GPU-f", "GPU-g", "GPU-h"), nvlink=())
    with pytest.raises(PreflightRefused) as e:
        plan(monkeypatch, saved, here, ["GPU-a", "GPU-b"])
    assert e.value.reason == "gpu_topology" and e.value.http_status == 422
    assert "GPUs 0 and 1 of the snapshot were joined by NVLink" in e.value.message
    assert "PCIe peer-to-peer" in e.value.message
    forced = dict(plan(monkeypatch, saved, here, ["GPU-a", "GPU-b"], force=True))
    assert forced["GPU-a"] != forced["GPU-b"]
    # a kernel that used one card of the pair has no link to keep: mapped without a word
    assert dict(plan(monkeypatch, saved, here, ["GPU-a"]))["GPU-a"] == "GPU-e"


def test_a_gpu_map_that_breaks_a_link_is_refused(monkeypatch):
    fp = fingerprint(monkeypatch)
    with pytest.raises(PreflightRefused) as e:  # b onto c: a and c are joined by PCIe only
        plan(monkeypatch, fp, fp, ["GPU-a", "GPU-b"], requested={"GPU-b": "GPU-c"})
    assert e.value.reason == "gpu_topology"
    # moving the whole pair onto the other NVLink pair is fine
    moved = dict(plan(monkeypatch, fp, fp, ["GPU-a", "GPU-b"],
                      requested={"GPU-a": "GPU-c", "GPU-b": "GPU-d"}))
    assert moved["GPU-a"] == "GPU-c" and moved["GPU-b"] == "GPU-d"


def test_too_few_cards_or_another_model_is_refused(monkeypatch):
    saved = fingerprint(monkeypatch)
    two = Fingerprint(gpus=saved.gpus[:2], driver_version=saved.driver_version,
                      cuda_driver_version=saved.cuda_driver_version, links=saved.links[:1])
    with pytest.raises(PreflightRefused) as e:
        plan(monkeypatch, saved, two, ["GPU-a", "GPU-b", "GPU-c"])
    assert e.value.reason == "gpu_mismatch" and "4 GPU(s)" in e.value.message
    assert "4 x NVIDIA H100" in e.value.message


def test_snapshots_without_links_still_restore(monkeypatch):
    """Snapshots taken before issue 33 have no links: nothing to compare, mapped by model."""
    fp = fingerprint(monkeypatch)
    old = Fingerprint.from_json({k: v for k, v in fp.to_json().items() if k != "links"})
    assert old.links == ()
    here = fingerprint(monkeypatch, uuids=("GPU-e", "GPU-f", "GPU-g", "GPU-h"))
    assert dict(plan(monkeypatch, old, here, ["GPU-a", "GPU-b"]))["GPU-a"] == "GPU-e"


def test_blocks_carry_their_card():
    """Segments of two cards side by side in the address space: each block is hashed on the
    card it lies on, and no block spans two segments."""
    mib = 1 << 20
    layout = [(0x1000_0000, 4 * mib, 0, 0), (0x1000_0000 + 4 * mib, 4 * mib, 4 * mib, 1)]
    items = block_hash.blocks([(0x1000_0000 + 3 * mib, 2 * mib)], layout)
    assert [(address - 0x1000_0000, n, device) for _, address, n, device in items] == \
        [(3 * mib, mib, 0), (4 * mib, mib, 1)]
    assert block_hash.devices_of(layout) == [0, 1]
