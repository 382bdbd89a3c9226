"""Lazy restore through the real server (``SnapshotManager.lazy_restore``, issue 32): the
restore answers with the kernel's memory still streaming in (helper and CRIU's lazy pages,
infinijup_helper/lazy_pages.py), and every byte is right, from the hot tier and from the
store, and in a snapshot taken straight after."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from kernelkit import Notebook, needs_helper
from test_resume import attach, value_after_resume

DIGEST = "__import__('hashlib').blake2b(blob).hexdigest()"


@needs_helper
@pytest.mark.timeout(300)
async def test_lazy_restores_from_hot_tier_and_store_keep_every_byte(notebook, jp_serverapp):
    nb = notebook
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.lazy_restore = True
    await nb.execute("import os; x = 'snapshotted'; blob = os.urandom(96 << 20)")
    digest = await nb.value(DIGEST)
    snap = await nb.snapshot(message="lazy")

    await nb.execute("x = 'moved on'; blob = b''")
    r = await nb.restore(snap["commit"])
    assert r["phases"]["images"] == "hot", r
    assert r["phases"]["pages"]["state"] in ("streaming", "resident"), r
    assert r["phases"]["whole_why"] is None
    assert await nb.value("x") == "snapshotted"
    assert await nb.value(DIGEST) == digest

    # a snapshot straight after a lazy restore holds every page (CRIU reads them through
    # the page daemon where they have not arrived yet)
    manager.hot_tier_bytes = 1  # kept out of the hot tier: its restore reads the store
    again = await nb.snapshot(message="after a lazy restore")
    await nb.execute("x = 'moved on'; blob = b''")
    r = await nb.restore(again["commit"])
    assert r["phases"]["images"] == "store", r
    assert r["phases"]["pages"]["state"] in ("streaming", "resident"), r
    # a live kernel was replaced: the pages were checked out (verified) before it was ended
    assert r["phases"]["pages_from_store"] is False, r
    assert await nb.value(DIGEST) == digest
    assert await nb.value("x") == "snapshotted"

    # a resume into a new kernel (nothing of the user's to lose) leaves the page files in
    # the store: the helper asks the server for them as the kernel runs (store_pages.py);
    # by default only from 1 GiB of pages on (a checkout is quicker below)
    manager.pages_from_store_min_bytes = 0
    await nb.fetch("api", "kernels", nb.kernel_id, method="DELETE")
    nb.kernel_id = ""
    r = await nb.post("resume", {"path": nb.path, "commit": again["commit"]})
    assert r.code == 200, r.body
    body = json.loads(r.body)
    assert body["phases"]["images"] == "store" and body["phases"]["pages_from_store"], body
    other = await attach(Notebook(nb.fetch, nb.ws_fetch, nb.path), body["kernel_id"])
    try:
        assert await other.value(DIGEST) == digest
        pages = (await _status(other))["pages"]
        while pages["state"] == "streaming":
            await asyncio.sleep(0.05)
            pages = (await _status(other))["pages"]
        assert pages["state"] == "resident", pages
        assert await other.value("x") == "snapshotted"
    finally:
        await other.close()


async def _status(nb) -> dict:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)


@needs_helper
@pytest.mark.timeout(300)
async def test_a_lazy_wake_keeps_every_byte_and_the_status_follows_the_pages(notebook,
                                                                            jp_serverapp):
    """Hibernation (serverext/hibernation.py) wakes through the same restore: with
    lazy_restore on, the cell that wakes the kernel runs while its memory streams in; the
    server's status shows the stream until it is resident."""
    nb = notebook
    jp_serverapp.web_app.settings["infinijup_manager"].lazy_restore = True
    await nb.execute("import os; blob = os.urandom(192 << 20)")
    digest = await nb.value(DIGEST)
    r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
    assert r.code == 200, r.body
    slept = await _status(nb)
    assert slept["state"] == "hibernated" and slept["pages"] is None  # no process to follow

    assert await nb.value(DIGEST) == digest  # the cell that wakes it reads every byte
    woke = await _status(nb)
    assert woke["state"] == "running"
    # restored lazily (the helper follows pages only for a lazily restored tree)
    assert woke["pages"] is not None and woke["pages"]["state"] in ("streaming", "resident")
    deadline = time.monotonic() + 120  # hang guard only
    while (now := await _status(nb))["pages"]["state"] == "streaming":
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.1)
    assert now["pages"]["state"] == "resident" and now["pages"]["error"] is None, now
    assert now["pages"]["resident_s"] > 0
    assert await nb.value(DIGEST) == digest


@needs_helper
@pytest.mark.timeout(300)
async def test_the_store_process_killed_mid_stream_ends_the_kernel_with_the_reason(
        notebook, jp_serverapp, monkeypatch):
    """The process serving a resume's pages from the store dies (SIGKILL at the 20th ask of
    the helper's stream, store/faults.py): the kernel is not left hanging in a fault nor run
    on zero pages; it is ended, the reason kept, and the snapshot resumes again. (The stream
    starts with CRIU's restore: whether the resume has answered by then decides which of
    the two outcomes below is seen; both keep every promise.)"""
    nb = notebook
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.lazy_restore, manager.pages_from_store_min_bytes, manager.hot_tier_bytes = True, 0, 1
    await nb.execute("import os; blob = os.urandom(96 << 20)")
    digest = await nb.value(DIGEST)
    snap = await nb.snapshot(message="to resume")
    await nb.fetch("api", "kernels", nb.kernel_id, method="DELETE")
    nb.kernel_id = ""

    monkeypatch.setenv("INFINIJUP_STORE_CRASH_AT", "store_pages_stream:20")  # of ~400 asks
    r = await nb.post("resume", {"path": nb.path, "commit": snap["commit"]})
    if r.code == 200:  # it answered before the 40th ask: the stream fails behind it
        body = json.loads(r.body)
        assert body["phases"]["pages_from_store"], body
        other = await attach(Notebook(nb.fetch, nb.ws_fetch, nb.path), body["kernel_id"])
        try:
            pages = (await _status(other))["pages"]
            while pages["state"] == "streaming":
                await asyncio.sleep(0.05)
                pages = (await _status(other))["pages"]
        finally:
            await other.close()
        assert pages["state"] == "failed", pages
        assert "the source stopped answering" in pages["error"], pages
        await nb.fetch("api", "kernels", body["kernel_id"], method="DELETE")
    else:  # the restore saw it (the kernel ended before it answered): with the reason
        assert r.code == 500, r.body
        assert "the source stopped answering" in json.loads(r.body)["message"], r.body

    monkeypatch.delenv("INFINIJUP_STORE_CRASH_AT")
    assert await value_after_resume(nb, snap["commit"], DIGEST) == digest
