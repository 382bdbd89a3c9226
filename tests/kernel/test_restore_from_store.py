"""A lazy restore in place whose page files stream from the store (issue 32, serverext/aside.py):
the kernel it replaces is kept aside, alive, until the restored memory is all back, then ended;
if the stream fails, that kernel is this kernel again, as it was before the restore. Real
server, helper, CRIU and store process; the failures are the store's serving process killed
at its 20th ask, and the restored kernel killed while the server is held before it follows
the memory (store/faults.py), never after a delay.

(A stream held in the store's process cannot stand in for a failure after the answer: CRIU's
page daemon reads the answers in the order it asked, so the kernel's faults would wait behind
the held ask.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from kernelkit import needs_helper
from test_lazy_restore import _status

DIGEST = "__import__('hashlib').blake2b(blob).hexdigest()"


@pytest.fixture
def streams_in_place(jp_serverapp):  # noqa: ANN201
    """Lazy restores, nothing in the hot tier, every page file served from the store."""
    from infinijup.helper_client import HelperClient

    features = HelperClient(os.environ["INFINIJUP_HELPER_SOCKET"]).hello().features
    if not features.get("pid_namespace"):
        pytest.skip("the helper gives kernels no PID namespaces here (CUDA usable): a restore "
                    "takes the snapshot's pids, so no kernel can be kept aside")
    m = jp_serverapp.web_app.settings["infinijup_manager"]
    m.lazy_restore, m.pages_from_store_min_bytes, m.hot_tier_bytes = True, 0, 1
    return m


async def _settled(nb) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + 120  # hang guard only
    while (now := await _status(nb))["lifecycle"] == "settling":
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.1)
    return now


async def _two_snapshots_then_changed(nb, mib: int = 96) -> tuple[dict, str, dict]:  # noqa: ANN001
    await nb.execute(f"import os; x = 'first'; blob = os.urandom({mib} << 20)")
    digest = await nb.value(DIGEST)
    first = await nb.snapshot(message="first")
    await nb.execute("x = 'second'; blob = os.urandom(32 << 20)")
    second = await nb.snapshot(message="second")
    await nb.execute("x = 'moved on'")
    return first, digest, second


@needs_helper
@pytest.mark.timeout(300)
async def test_the_kernel_replaced_is_kept_until_the_memory_from_the_store_is_back(
        notebook, streams_in_place):
    nb = notebook
    first, digest, _second = await _two_snapshots_then_changed(nb)

    r = await nb.restore(first["commit"])
    assert r["phases"]["images"] == "store" and r["phases"]["pages_from_store"], r
    kept = r["kept_until_resident"]
    assert isinstance(kept, int), r
    assert await nb.value("x") == "first"
    assert await nb.value(DIGEST) == digest

    now = await _settled(nb)
    assert now["lifecycle"] == "running", now
    assert now["pages"]["state"] == "resident", now
    assert now["head"]["commit"] == first["commit"], now
    deadline = time.monotonic() + 30  # hang guard: the helper reaps the tree it ended
    while os.path.exists(f"/proc/{kept}"):
        assert time.monotonic() < deadline, f"the kernel kept aside (pid {kept}) still runs"
        await asyncio.sleep(0.05)
    assert await nb.value("x") == "first"


@needs_helper
@pytest.mark.timeout(300)
async def test_a_stream_from_the_store_that_fails_gives_the_kernel_back_as_it_was(
        notebook, streams_in_place, monkeypatch):
    """(The stream starts with CRIU's restore: whether the restore has answered when the
    store's process dies decides which of the two ways below the kernel comes back; both end
    with the kernel as it was, and say why.)"""
    nb = notebook
    first, digest, second = await _two_snapshots_then_changed(nb)
    before = await nb.value(DIGEST)

    monkeypatch.setenv("INFINIJUP_STORE_CRASH_AT", "store_pages_stream:20")  # of ~100 asks
    r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": first["commit"]})
    if r.code == 200:  # it answered first: the kernel kept aside comes back behind it
        body = json.loads(r.body)
        assert body["phases"]["pages_from_store"] and body["kept_until_resident"], body
        now = await _settled(nb)
    else:  # the restore saw it before the answer: the kernel kept aside was taken back then
        assert r.code == 500, r.body
        assert "the source stopped answering" in json.loads(r.body)["message"], r.body
        now = await _status(nb)
    monkeypatch.delenv("INFINIJUP_STORE_CRASH_AT")

    assert now["lifecycle"] == "running", now
    assert now["head"]["commit"] == second["commit"], now  # where it stood before
    assert await nb.value("x") == "moved on"
    assert await nb.value(DIGEST) == before

    # the snapshot is intact: the same restore again, the store's process left alone
    r = await nb.restore(first["commit"])
    assert r["phases"]["pages_from_store"], r
    assert await nb.value(DIGEST) == digest
    assert (await _settled(nb))["pages"]["state"] == "resident"


@needs_helper
@pytest.mark.timeout(300)
async def test_a_restored_kernel_that_ends_before_its_memory_is_back_gives_way(
        notebook, streams_in_place, tmp_path, monkeypatch):
    """The restore answers; the server is held before it follows the memory (a hold point,
    aside.py), and the restored kernel is killed meanwhile. The kernel kept aside is this
    kernel again, as it was, and the failure is reported."""
    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv("INFINIJUP_STORE_HOLDS", str(holds))
    nb = notebook
    first, _digest, second = await _two_snapshots_then_changed(nb)
    before = await nb.value(DIGEST)

    (holds / "keep_until_resident").touch()
    r = await nb.restore(first["commit"])
    assert r["phases"]["pages_from_store"] and r["kept_until_resident"], r
    assert await nb.value("x") == "first"
    assert (await _status(nb))["lifecycle"] == "settling"
    await _reached(holds / "keep_until_resident")
    restored = streams_in_place.kernel(nb.kernel_id).provisioner.root_pid
    assert restored != r["kept_until_resident"]
    os.kill(restored, signal.SIGKILL)
    (holds / "keep_until_resident").unlink()

    now = await _settled(nb)
    assert now["lifecycle"] == "running", now
    assert now["head"]["commit"] == second["commit"], now
    assert await nb.value("x") == "moved on"
    assert await nb.value(DIGEST) == before
    assert streams_in_place.kernel(nb.kernel_id).provisioner.root_pid == \
        r["kept_until_resident"]


@needs_helper
@pytest.mark.timeout(300)
async def test_a_stopping_server_ends_the_kernel_kept_aside(notebook, streams_in_place, tmp_path,
                                                           monkeypatch):
    """Held before the server follows the memory, the server stops: its ``cleanup_kernels``
    (serverext/__init__.py) first calls ``end_all_kept``, called here, which ends the kernel
    kept aside (no kernel of the server's, so stopping the kernels would leave it); the
    restored kernel runs on."""
    from infinijup.serverext import aside

    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv("INFINIJUP_STORE_HOLDS", str(holds))
    nb = notebook
    first, digest, _second = await _two_snapshots_then_changed(nb)
    (holds / "keep_until_resident").touch()
    r = await nb.restore(first["commit"])
    kept = r["kept_until_resident"]
    await _reached(holds / "keep_until_resident")
    assert os.path.exists(f"/proc/{kept}")
    await aside.end_all_kept(streams_in_place)
    deadline = time.monotonic() + 30  # hang guard: the helper reaps the tree it ended
    while os.path.exists(f"/proc/{kept}"):
        assert time.monotonic() < deadline, f"the kernel kept aside (pid {kept}) still runs"
        await asyncio.sleep(0.05)
    (holds / "keep_until_resident").unlink()
    assert (await _settled(nb))["lifecycle"] == "running"
    assert await nb.value(DIGEST) == digest


async def _reached(point: Path) -> int:
    """The pid of the process held at ``point``."""
    done = Path(f"{point}.reached")
    deadline = time.monotonic() + 120  # hang guard only
    while not done.exists():
        assert time.monotonic() < deadline, f"{point.name} was never reached"
        await asyncio.sleep(0.02)
    return int(done.read_text())


@needs_helper
@pytest.mark.timeout(300)
async def test_a_kernel_the_helper_will_not_keep_aside_is_restored_from_a_checkout(
        notebook, streams_in_place, tmp_path, monkeypatch):
    """The kernel maps the CUDA driver (a stand-in file of that name), which the server's own
    look is kept from seeing here: the helper refuses to keep it aside, before anything is
    touched, and the restore checks the page files out and goes on."""
    nb = notebook
    monkeypatch.setattr(streams_in_place, "uses_gpu", lambda kernel_id: False)
    first, digest, _second = await _two_snapshots_then_changed(nb)
    driver = tmp_path / "libcuda.so.1"
    driver.write_bytes(b"\x7fELF" + bytes(8188))
    await nb.execute(f"import mmap\ncuda_file = open({str(driver)!r}, 'rb')\n"
                     "cuda_map = mmap.mmap(cuda_file.fileno(), 8192, prot=mmap.PROT_READ)")
    r = await nb.restore(first["commit"])
    assert r["phases"]["images"] == "store" and not r["phases"]["pages_from_store"], r
    assert "kept_until_resident" not in r, r
    assert (await _status(nb))["lifecycle"] == "running"
    assert await nb.value("x") == "first"
    assert await nb.value(DIGEST) == digest


@needs_helper
@pytest.mark.timeout(300)
async def test_off_the_pages_are_checked_out_before_the_kernel_is_replaced(
        notebook, streams_in_place):
    nb = notebook
    streams_in_place.restore_keeps_replaced = False
    first, digest, _second = await _two_snapshots_then_changed(nb)
    r = await nb.restore(first["commit"])
    assert r["phases"]["images"] == "store" and not r["phases"]["pages_from_store"], r
    assert "kept_until_resident" not in r, r
    assert (await _status(nb))["lifecycle"] == "running"
    assert await nb.value(DIGEST) == digest
