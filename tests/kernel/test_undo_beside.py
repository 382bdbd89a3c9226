"""Undo beside the kernel it leaves (issue 30: serverext/undo.py, engine/set_aside.py), against
a real server, helper and CRIU. The kernel left is set aside alive while the snapshot comes
back, and dumped and stored behind it: here that late save is held at its ``set_aside`` point
(``INFINIJUP_STORE_HOLDS``, store/faults.py), so each test looks at the moment in between
without depending on how fast this machine is."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(300)]


@pytest.fixture
def sets_aside(jp_server_config) -> None:
    """Kernels set aside need PID namespaces, which the helper leaves off where CUDA is usable
    (the GPU hosts): there every undo stores first (the last test below)."""
    from infinijup.helper_client import HelperClient

    features = HelperClient(os.environ["INFINIJUP_HELPER_SOCKET"]).hello().features
    if not features.get("pid_namespace"):
        pytest.skip("this helper runs kernels without PID namespaces (as where CUDA is usable): "
                    "no kernel is set aside")


@pytest.fixture
def holds(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "holds"
    directory.mkdir()
    monkeypatch.setenv("INFINIJUP_STORE_HOLDS", str(directory))
    return directory


async def reached(point: Path) -> None:
    for _ in range(6000):  # hang guard only: waits for the file the point writes
        if Path(f"{point}.reached").exists():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{point.name} was never reached")


def set_aside_files(jp_serverapp, nb) -> list[Path]:
    """The socket files of a kernel set aside, in the kernel's endpoint directory."""
    km = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id)
    directory = Path(km.get_connection_info()["ip"]).parent
    return sorted(directory.glob(".aside-*"))


async def standing_on_a_snapshot_then_changed(nb) -> None:
    await nb.execute("%autosnapshot off")
    await nb.execute("import random\nx = 1\nrandom.seed(3)")
    await nb.snapshot(message="x is 1")
    await nb.execute("x = 2\nr = random.random()")  # quick: no snapshot of it


async def undo(nb) -> dict:
    r = await nb.post("undo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    return json.loads(r.body)


async def test_the_undone_kernel_answers_before_the_state_left_is_stored(
        notebook, holds, jp_serverapp, sets_aside):
    nb = notebook
    await standing_on_a_snapshot_then_changed(nb)
    (holds / "set_aside").touch()
    moved = await undo(nb)
    assert moved["saving"] is True and moved["from"] is None, moved
    assert moved["says"].startswith("Back to"), moved
    await reached(holds / "set_aside")
    # the kernel left lives beside the restored one, not yet dumped; the restored one answers
    files = set_aside_files(jp_serverapp, nb)
    assert files, "no socket file was set aside"
    left_pid = int(files[0].name.split("-")[1])
    assert os.path.exists(f"/proc/{left_pid}")
    assert await nb.value("x") == 1
    # a redo now waits for the state left, then goes back to it
    redo = asyncio.ensure_future(nb.post("redo", {"kernel_id": nb.kernel_id}))
    (holds / "set_aside").unlink()
    r = await redo
    assert r.code == 200, r.body
    assert await nb.value("x") == 2
    assert await nb.value("r") == __import__("random").Random(3).random()
    assert not os.path.exists(f"/proc/{left_pid}")  # dumped and ended
    assert set_aside_files(jp_serverapp, nb) == []
    commits = (await nb.history())["commits"]
    assert [c["message"] for c in commits].count("before undo") == 1


async def test_a_late_save_that_fails_is_reported_and_leaves_the_kernel_running(
        notebook, holds, jp_serverapp, sets_aside, operation_events):
    nb, seen = notebook, operation_events
    await standing_on_a_snapshot_then_changed(nb)
    (holds / "set_aside").touch()
    await undo(nb)
    await reached(holds / "set_aside")
    files = set_aside_files(jp_serverapp, nb)
    left_pid = int(files[0].name.split("-")[1])
    os.kill(left_pid, signal.SIGKILL)  # the kernel left dies before its dump
    (holds / "set_aside").unlink()
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})  # (waits for the late save)
    assert r.code == 409 and json.loads(r.body)["reason"] == "nothing_to_redo", r.body
    assert await nb.value("x") == 1  # the user's kernel runs on
    assert set_aside_files(jp_serverapp, nb) == []
    for _ in range(200):  # listeners run as tasks: let them drain
        if any(e["phase"] == "error" for e in seen):
            break
        await asyncio.sleep(0.05)
    errors = [e for e in seen if e["phase"] == "error"]
    assert len(errors) == 1 and errors[0]["op"] == "snapshot", errors  # reported once


@pytest.mark.parametrize("seen_by", ["server", "helper"])
async def test_a_kernel_that_cannot_be_set_aside_is_saved_first(notebook, tmp_path, seen_by,
                                                                jp_serverapp, monkeypatch):
    """It maps the CUDA driver (a stand-in file of that name): the server sees it and does
    not try, or (its look taken away here) the helper refuses to keep it beside the restore;
    either way the state it leaves is stored before the undo goes back."""
    nb = notebook
    if seen_by == "helper":
        m = jp_serverapp.web_app.settings["infinijup_manager"]
        monkeypatch.setattr(m, "uses_gpu", lambda kernel_id: False)
    await standing_on_a_snapshot_then_changed(nb)
    driver = tmp_path / "libcuda.so.1"
    driver.write_bytes(b"\x7fELF" + bytes(8188))
    await nb.execute(f"import mmap\ncuda_file = open({str(driver)!r}, 'rb')\n"
                     "cuda_map = mmap.mmap(cuda_file.fileno(), 8192, prot=mmap.PROT_READ)")
    moved = await undo(nb)
    assert moved["saving"] is False and moved["from"] is not None, moved
    assert await nb.value("x") == 1
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert await nb.value("x") == 2
    assert await nb.value("cuda_map[:4]") == b"\x7fELF"


async def test_with_too_little_free_memory_the_state_left_is_stored_first(
        notebook, monkeypatch, sets_aside):
    """A second copy of the kernel would not fit (the machine's free memory read as none)."""
    from infinijup.serverext import undo as undo_module

    nb = notebook
    await standing_on_a_snapshot_then_changed(nb)
    monkeypatch.setattr(undo_module, "host_memory", lambda: (0, 64 << 30))
    moved = await undo(nb)
    assert moved["saving"] is False and moved["from"] is not None, moved
    assert await nb.value("x") == 1
