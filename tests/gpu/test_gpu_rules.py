"""CPU-only parts of the GPU stage: fingerprint rules, preflight decisions, unwinding.

The driver calls are replaced by a recording fake only to isolate the unwinding logic; the
real driver path runs on the GPU machine (tests/gpu/test_gpu_kernel.py). The preflight and the
driver calls are the helper's (infinijup_helper/cuda_preflight.py, cuda_driver.py); the
fingerprint rules and the restore plan are the server's (infinijup/gpu)."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest

from infinijup.errors import PreflightRefused
from infinijup.gpu import preflight
from infinijup.gpu.fingerprint import Fingerprint, GpuInfo, mismatches, remap
from infinijup.gpu.preflight import GpuReport
from infinijup_helper import cuda_driver as driver
from infinijup_helper import cuda_preflight
from infinijup_helper.cuda_preflight import GpuProcess, check

H100 = "NVIDIA H100 80GB HBM3"


def gpu(i, name=H100, uuid=None, mig=False):
    return GpuInfo(index=i, name=name, uuid=uuid or f"GPU-{i}", pci_bus_id=f"0000:{i:02x}:00.0",
                   memory_total=80 * 2**30, mig_enabled=mig)


def fp(*gpus, drv="580.159.04"):
    return Fingerprint(gpus=tuple(gpus), driver_version=drv, cuda_driver_version=13000)


def test_same_hardware_matches():
    assert mismatches(fp(gpu(0)), fp(gpu(0))) == []


def test_other_gpu_of_same_model_is_remapped():
    saved, here = fp(gpu(0, uuid="GPU-a")), fp(gpu(0, uuid="GPU-b"))
    assert mismatches(saved, here) == []
    assert remap(saved, here) == [("GPU-a", "GPU-b")]


def test_model_count_and_driver_mismatches_are_named():
    assert "model differs" in mismatches(fp(gpu(0)), fp(gpu(0, name="NVIDIA H200")))[0]
    assert "2 GPU(s)" in mismatches(fp(gpu(0), gpu(1)), fp(gpu(0)))[0]
    assert "driver differs" in mismatches(fp(gpu(0)), fp(gpu(0), drv="575.1"))[0]
    assert mismatches(fp(gpu(0)), fp(gpu(0), drv="580.200.01")) == []


def test_fingerprint_round_trips_json():
    f = fp(gpu(0), gpu(1, uuid="GPU-x"))
    assert Fingerprint.from_json(f.to_json()) == f


def report(*procs, gpus=None, drv="580.159.04"):
    """The helper's NVML report (its fingerprint as the JSON that goes into the commit)."""
    gpus = gpus if gpus is not None else (gpu(0),)
    return cuda_preflight.GpuReport(fingerprint=fp(*gpus, drv=drv).to_json(),
                                    processes=tuple(procs))


def test_preflight_refuses_old_driver():
    with pytest.raises(cuda_preflight.PreflightRefused) as e:
        check(report(GpuProcess(10, "GPU-0", 1), drv="550.54"), {10})
    assert e.value.reason == "driver_too_old" and e.value.http_status == 422


def test_preflight_refuses_mig():
    with pytest.raises(cuda_preflight.PreflightRefused) as e:
        check(report(GpuProcess(10, "GPU-0", 1), gpus=(gpu(0, mig=True),)), {10})
    assert e.value.reason == "mig_unsupported"


def test_preflight_warns_about_outside_processes_and_counts_usage():
    r = report(GpuProcess(10, "GPU-0", 5), GpuProcess(11, "GPU-0", 7), GpuProcess(99, "GPU-0", 1))
    warnings = check(r, {10, 11})
    assert len(warnings) == 1 and "99" in warnings[0]
    assert r.usage_by_gpu({10, 11}) == {"GPU-0": 12}


def fake_pynvml() -> types.ModuleType:
    """pynvml as it answers on a machine with two GPUs (the second in MIG mode), each used by
    one process; the strings as bytes, as older nvidia-ml-py gives them."""
    m = types.ModuleType("pynvml")
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetMigMode = lambda h: (int(h == 1), 0)
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}".encode()
    m.nvmlDeviceGetName = lambda h: H100.encode()
    m.nvmlDeviceGetPciInfo = lambda h: SimpleNamespace(busId=f"0000:{h:02x}:00.0".encode())
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=80 * 2**30)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        SimpleNamespace(pid=10 + h, usedGpuMemory=(h + 1) << 20)]
    m.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    m.nvmlSystemGetCudaDriverVersion = lambda: 13000
    return m


def test_helper_and_server_read_nvml_alike(monkeypatch):
    """The helper reads NVML itself (it imports nothing of infinijup): the fingerprint it puts
    into a commit is what the server's Fingerprint reads back, and the usage is the same."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    server, helper = preflight.read_nvml(), cuda_preflight.read_nvml()
    assert helper.fingerprint == server.fingerprint.to_json()
    assert Fingerprint.from_json(json.loads(json.dumps(helper.fingerprint))) == server.fingerprint
    assert server.fingerprint.gpus[1].mig_enabled and server.fingerprint.driver_version == \
        "580.159.04"
    assert helper.usage_by_gpu({10, 11}) == server.usage_by_gpu({10, 11}) == \
        {"GPU-0": 1 << 20, "GPU-1": 2 << 20}
    with pytest.raises(cuda_preflight.PreflightRefused) as e:
        check(helper, {11})
    assert e.value.reason == "mig_unsupported"


class FakeDriver:
    """Records calls; fails the checkpoint of one pid."""

    def __init__(self, fail_pid):
        self.fail_pid, self.calls, self.states = fail_pid, [], {}

    def suspend(self, pid, timeout_ms):
        self.calls.append(("suspend", pid))
        if pid == self.fail_pid:
            raise driver.CudaError("checkpoint failed")
        self.states[pid] = driver.CudaState.CHECKPOINTED

    def resume(self, pid):
        self.calls.append(("resume", pid))
        self.states[pid] = driver.CudaState.RUNNING


def test_failed_suspend_resumes_what_was_suspended(monkeypatch):
    from infinijup_helper import cuda_stage
    from infinijup_helper.stages import StageBase, run_stages

    fake = FakeDriver(fail_pid=3)
    monkeypatch.setattr(cuda_stage, "cuda_pids", lambda root, owner=None: [1, 2, 3])
    monkeypatch.setattr(cuda_stage, "read_nvml", lambda: report(GpuProcess(1, "GPU-0", 1)))
    monkeypatch.setattr(cuda_stage, "tree_pids", lambda root, owner=None: [1, 2, 3])
    monkeypatch.setattr(cuda_stage.driver, "suspend", fake.suspend)
    monkeypatch.setattr(cuda_stage.driver, "resume", fake.resume)
    stage = cuda_stage.CudaSuspend(1)
    with pytest.raises(driver.CudaError):
        run_stages([stage], object(), lambda *a: None)
    # The stage itself failed: it resumed the two it had suspended before re-raising.
    assert ("resume", 1) in fake.calls and ("resume", 2) in fake.calls
    assert all(s is driver.CudaState.RUNNING for s in fake.states.values())

    # A later stage fails (say CRIU): the GPU stage is rolled back, nothing stays checkpointed.
    fake2 = FakeDriver(fail_pid=None)
    monkeypatch.setattr(cuda_stage.driver, "suspend", fake2.suspend)
    monkeypatch.setattr(cuda_stage.driver, "resume", fake2.resume)

    class CriuFails(StageBase):
        name = "dump"

        def run(self, ctx):
            raise RuntimeError("criu failed")

    with pytest.raises(RuntimeError):
        run_stages([cuda_stage.CudaSuspend(1), CriuFails()], object(), lambda *a: None)
    assert [c for c in fake2.calls if c[0] == "resume"] == [("resume", 1), ("resume", 2), ("resume", 3)]


def test_gpu_restore_plan(monkeypatch):
    from infinijup.errors import BadRequest
    from infinijup.gpu import restore_rules

    a, b = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
    c = "GPU-cccccccc-0000-0000-0000-000000000000"
    here = fp(gpu(0, uuid=a), gpu(1, uuid=b))
    monkeypatch.setattr(restore_rules, "read_nvml", lambda: GpuReport(here, ()))
    meta = {"gpu": {"fingerprint": here.to_json()}}
    assert restore_rules.plan_gpu_restore({}) == ()  # a CPU snapshot
    assert restore_rules.plan_gpu_restore(meta) == ()  # same GPUs: nothing moves
    # Moving GPU a onto b swaps them: the map stays a permutation.
    assert restore_rules.plan_gpu_restore(meta, requested={a: b}) == ((a, b), (b, a))
    # Saved on another machine's GPU of the same model: mapped onto the first free one here.
    elsewhere = {"gpu": {"fingerprint": fp(gpu(0, uuid=c)).to_json()}}
    assert restore_rules.plan_gpu_restore(elsewhere) == ((c, a),)
    with pytest.raises(BadRequest):
        restore_rules.plan_gpu_restore(meta, requested={c: a})
    h200 = {"gpu": {"fingerprint": fp(gpu(0, name="NVIDIA H200", uuid=c)).to_json()}}
    with pytest.raises(PreflightRefused) as e:
        restore_rules.plan_gpu_restore(h200)
    assert e.value.reason == "gpu_mismatch"
    assert restore_rules.plan_gpu_restore(h200, force=True) == ()  # nothing of that model here


def test_helper_protocol_validates_gpu_maps():
    from infinijup_helper.protocol import RequestError, parse_request

    ok = {"v": 1, "id": 1, "op": "restore", "args": {
        "images_dir": "/x", "gpu_map": [["GPU-aaaaaaaa-0000-0000-0000-000000000000",
                                         "GPU-bbbbbbbb-0000-0000-0000-000000000000"]]}}
    assert parse_request(json.dumps(ok).encode()).args.gpu_map[0][1].startswith("GPU-bbbb")
    for bad in (["GPU-1"], [["GPU-x", "GPU-y"]], "GPU", [[1, 2]]):
        req = {**ok, "args": {"images_dir": "/x", "gpu_map": bad}}
        with pytest.raises(RequestError):
            parse_request(json.dumps(req).encode())
