"""Undo beside the kernel it leaves (issue 30: serverext/undo.py, engine/set_aside.py), against
a real server, helper and CRIU. The kernel left is set aside alive while the snapshot comes
back, and dumped and stored behind it; where it cannot be set aside, it is dumped first and
stored behind the restore. Here those late saves are held at their ``set_aside`` or
``before_ingest`` points (``INFINIJUP_STORE_HOLDS``, store/faults.py), so each test looks at
the moment in between without depending on how fast this machine is."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(300)]


@pytest.fixture
def sets_aside(jp_server_config) -> None:
    """Kernels set aside need PID namespaces, which the helper leaves off where CUDA is usable
    (the GPU hosts): there every undo dumps first (the tests after these)."""
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


async def back_to_the_state_left(nb, redo) -> None:  # noqa: ANN001 - the redo's request
    r = await redo
    assert r.code == 200, r.body
    assert await nb.value("x") == 2
    assert await nb.value("r") == __import__("random").Random(3).random()


async def stored_once(nb) -> None:
    commits = (await nb.history())["commits"]
    assert [c["message"] for c in commits].count("before undo") == 1


async def reported_once(seen: list[dict]) -> None:
    for _ in range(200):  # listeners run as tasks: let them drain
        if any(e["phase"] == "error" for e in seen):
            break
        await asyncio.sleep(0.05)
    errors = [e for e in seen if e["phase"] == "error"]
    assert len(errors) == 1 and errors[0]["op"] == "snapshot", errors


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
    await back_to_the_state_left(nb, redo)
    assert not os.path.exists(f"/proc/{left_pid}")  # dumped and ended
    assert set_aside_files(jp_serverapp, nb) == []
    await stored_once(nb)


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
    await reported_once(seen)


def manager(jp_serverapp):  # noqa: ANN201
    return jp_serverapp.web_app.settings["infinijup_manager"]


async def test_a_stopping_server_ends_the_kernel_set_aside(notebook, holds, jp_serverapp,
                                                          sets_aside, operation_events):
    """Held before its dump, the server stops: its ``cleanup_kernels`` (serverext/__init__.py)
    first calls ``end_all_kept``, called here, which ends the kernel set aside (no kernel of
    the server's, so stopping the kernels would leave it). Its late save then fails, said
    once; the undone kernel runs on."""
    from infinijup.serverext import aside

    nb, seen = notebook, operation_events
    await standing_on_a_snapshot_then_changed(nb)
    (holds / "set_aside").touch()
    await undo(nb)
    await reached(holds / "set_aside")
    left_pid = int(set_aside_files(jp_serverapp, nb)[0].name.split("-")[1])
    assert os.path.exists(f"/proc/{left_pid}")
    await aside.end_all_kept(manager(jp_serverapp))
    for _ in range(600):  # hang guard only: the helper reaps the tree it ended
        if not os.path.exists(f"/proc/{left_pid}"):
            break
        await asyncio.sleep(0.05)
    assert not os.path.exists(f"/proc/{left_pid}"), "the kernel set aside still runs"
    assert set_aside_files(jp_serverapp, nb) == []
    (holds / "set_aside").unlink()
    await reported_once(seen)
    assert await nb.value("x") == 1


@pytest.mark.parametrize("seen_by", ["server", "helper"])
async def test_a_kernel_that_cannot_be_set_aside_is_dumped_first(notebook, tmp_path, seen_by,
                                                                 jp_serverapp, monkeypatch):
    """It maps the CUDA driver (a stand-in file of that name): the server sees it and does
    not try, or (its look taken away here) the helper refuses to keep it beside the restore;
    either way it is dumped first, and stored behind the restore."""
    nb = notebook
    if seen_by == "helper":
        monkeypatch.setattr(manager(jp_serverapp), "uses_gpu", lambda kernel_id: False)
    await standing_on_a_snapshot_then_changed(nb)
    driver = tmp_path / "libcuda.so.1"
    driver.write_bytes(b"\x7fELF" + bytes(8188))
    await nb.execute(f"import mmap\ncuda_file = open({str(driver)!r}, 'rb')\n"
                     "cuda_map = mmap.mmap(cuda_file.fileno(), 8192, prot=mmap.PROT_READ)")
    moved = await undo(nb)
    assert moved["saving"] is True and moved["from"] is None, moved
    assert await nb.value("x") == 1
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})  # (waits for the late store)
    assert r.code == 200, r.body
    assert await nb.value("x") == 2
    assert await nb.value("cuda_map[:4]") == b"\x7fELF"


async def test_with_too_little_free_memory_the_kernel_is_dumped_first(
        notebook, jp_serverapp, monkeypatch, sets_aside):
    """A second copy of the kernel would not fit (the machine's free memory read as none)."""
    nb = notebook
    await standing_on_a_snapshot_then_changed(nb)
    monkeypatch.setattr(manager(jp_serverapp), "host_memory", lambda: (0, 64 << 30))
    moved = await undo(nb)
    assert moved["saving"] is True and moved["from"] is None, moved
    assert await nb.value("x") == 1


@pytest.fixture
def dumps_first(jp_serverapp, monkeypatch) -> None:
    """No kernel is set aside (as on the GPU hosts, or with this setting)."""
    monkeypatch.setattr(manager(jp_serverapp), "undo_sets_aside", False)


async def test_dumped_first_the_undone_kernel_answers_before_the_state_left_is_stored(
        notebook, holds, dumps_first):
    nb = notebook
    await standing_on_a_snapshot_then_changed(nb)
    (holds / "before_ingest").touch()
    moved = await undo(nb)
    assert moved["saving"] is True and moved["from"] is None, moved
    assert Path(f"{holds / 'before_ingest'}.reached").exists()  # its store had not begun
    assert await nb.value("x") == 1
    # a redo waits for the state left (without it there would be nothing to redo)
    redo = asyncio.ensure_future(nb.post("redo", {"kernel_id": nb.kernel_id}))
    (holds / "before_ingest").unlink()
    await back_to_the_state_left(nb, redo)
    await stored_once(nb)


async def test_dumped_first_a_late_store_that_fails_is_reported_once(
        notebook, holds, dumps_first, jp_serverapp, operation_events):
    nb, seen = notebook, operation_events
    await standing_on_a_snapshot_then_changed(nb)
    (holds / "before_ingest").touch()
    await undo(nb)
    await reached(holds / "before_ingest")
    dumps = [p.parent for p in (manager(jp_serverapp).engine().work_dir() / "images").glob(
        "*/pagemap-*.img")]
    assert dumps, "the images being stored were not found"
    for dump in set(dumps):  # the store's source goes: its ingest fails
        shutil.rmtree(dump)
    (holds / "before_ingest").unlink()
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})  # (waits for the late store)
    assert r.code == 409 and json.loads(r.body)["reason"] == "nothing_to_redo", r.body
    assert await nb.value("x") == 1  # the user's kernel runs on
    await reported_once(seen)


async def test_dumped_first_a_restore_that_fails_after_ending_the_kernel_goes_back(
        notebook, dumps_first):
    """CRIU fails after the kernel was ended: a directory the snapshot's kernel had open has
    another mode since (as in tests/reliability/test_restore_failures.py). The kernel comes
    back in the state it left, once that is stored, and the answer says so."""
    nb = notebook
    opened = Path(tempfile.mkdtemp(prefix="ij-undo-"))
    mode = os.stat(opened).st_mode & 0o7777
    try:
        await nb.execute("%autosnapshot off")
        await nb.execute(f"import os, random\nx = 1\ndfd = os.open({str(opened)!r}, "
                         "os.O_RDONLY)\nrandom.seed(3)")
        await nb.snapshot(message="x is 1")
        await nb.execute("os.close(dfd)\nx = 2\nr = random.random()")
        os.chmod(opened, mode ^ 0o055)
        r = await nb.post("undo", {"kernel_id": nb.kernel_id})
        assert r.code == 500, r.body
        body = json.loads(r.body)
        assert body["reason"] == "criu_failed", body
        assert "brought back to the state it left" in body["message"], body
        assert await nb.value("x") == 2
        draws = __import__("random").Random(3)
        assert await nb.value("r") == draws.random()
        assert await nb.value("random.random()") == draws.random()  # the RNG goes on
        os.chmod(opened, mode)
        moved = await undo(nb)  # unchanged since the state it went back to: one step back
        assert moved["saving"] is False, moved
        assert await nb.value("x") == 1
    finally:
        os.chmod(opened, mode)
        os.rmdir(opened)


async def test_with_the_store_waited_for_the_state_left_is_stored_first(
        notebook, dumps_first, jp_serverapp, monkeypatch):
    monkeypatch.setattr(manager(jp_serverapp), "undo_stores_behind", False)
    nb = notebook
    await standing_on_a_snapshot_then_changed(nb)
    moved = await undo(nb)
    assert moved["saving"] is False and moved["from"] is not None, moved
    assert await nb.value("x") == 1
    r = await nb.post("redo", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    assert await nb.value("x") == 2
