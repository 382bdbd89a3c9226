"""Restores that fail: a corrupt pack, a missing pack, CRIU refusing the images. The kernel that
ran before is still usable (or cleanly restarted, with the reason shown) and no snapshot
changes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from reliakit import (
    assert_store_ok,
    fill,
    needs_helper,
    provisioner,
    state_intact,
    store_cli,
    store_state,
    wait_restarted,
)

pytestmark = [needs_helper, pytest.mark.timeout(240)]


@pytest.fixture
def jp_server_config(jp_server_config):
    """These restores must read their images from the store: no hot tier (hot_tier.py)."""
    jp_server_config["SnapshotManager"]["hot_tier_bytes"] = 0
    return jp_server_config


def _pages_chunk(store: str, commit_id: str) -> tuple[Path, int, int]:
    """Pack file, offset and length of a chunk in the middle of the commit's largest image."""
    from infinijup.store import Repository
    from infinijup.store.packs import pack_path

    with Repository.open(Path(store)) as repo:
        tree = repo.get_tree(repo.get_commit(commit_id).tree)
        biggest = max((e for e in tree if e.kind == "file"), key=lambda e: e.size)
        _size, chunks = repo.get_blob_chunks(biggest.id)
        loc = repo.index.lookup(chunks[len(chunks) // 2])
        return Path(pack_path(repo.packs_dir, loc.pack)), loc.offset, loc.length


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


async def _snapshot_then_move_on(nb, seed: int):
    digest = await fill(nb, 100, seed=seed)
    await nb.execute("x = 'snapshotted'")
    snap = await nb.snapshot(message="to restore")
    await nb.execute("x = 'current'")
    return digest, snap


async def test_restore_from_corrupt_pack(notebook, jp_serverapp, rhelper, store_path):
    nb = notebook
    digest, snap = await _snapshot_then_move_on(nb, seed=61)
    root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    before = store_state(store_path)
    pack, offset, length = _pages_chunk(store_path, snap["commit"])
    _flip(pack, offset + length // 2)

    r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": snap["commit"]})
    assert r.code == 500, r.body
    body = json.loads(r.body)
    assert body["reason"] == "checksum_mismatch", body
    assert pack.name in body["message"] and "kernel was not touched" in body["message"], body
    # checked out before the kernel was touched: the same kernel, the same state
    assert provisioner(jp_serverapp, nb.kernel_id).root_pid == root
    await state_intact(nb, digest, {"x": "current"})
    assert store_state(store_path) == before
    assert rhelper.user_entries() == {"images": [], "restore": []}
    check = store_cli(store_path, "check", "--read-data")
    assert check.returncode == 1 and pack.name in check.stdout, check.stdout
    # repaired, the very same commit restores
    _flip(pack, offset + length // 2)
    assert_store_ok(store_path)
    await nb.restore(snap["commit"])
    await state_intact(nb, digest, {"x": "snapshotted"})


async def test_restore_with_missing_pack(notebook, jp_serverapp, rhelper, store_path):
    nb = notebook
    digest, snap = await _snapshot_then_move_on(nb, seed=62)
    root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    before = store_state(store_path)
    pack, _offset, _length = _pages_chunk(store_path, snap["commit"])
    aside = Path(tempfile.mkdtemp()) / pack.name
    shutil.move(pack, aside)
    try:
        r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": snap["commit"]})
        assert r.code == 500, r.body
        body = json.loads(r.body)
        assert body["reason"] == "object_missing" and pack.name in body["message"], body
        assert provisioner(jp_serverapp, nb.kernel_id).root_pid == root
        await state_intact(nb, digest, {"x": "current"})
        assert store_state(store_path) == before
        check = store_cli(store_path, "check")
        assert check.returncode == 1 and pack.name in check.stdout, check.stdout
    finally:
        shutil.move(aside, pack)
        aside.parent.rmdir()
    assert_store_ok(store_path)
    await nb.restore(snap["commit"])
    await state_intact(nb, digest, {"x": "snapshotted"})


async def test_restore_of_damaged_images(notebook, jp_serverapp, rhelper, store_path):
    """Images the store holds intact but that are damaged (a process's memory image cut in
    half, committed as such): the helper refuses them before it touches the kernel. (CRIU
    4.2.1 itself spun at 100% CPU for good on such images, after the kernel was gone.)"""
    from infinijup.engine.naming import notebook_key, store_thread
    from infinijup.store import Repository
    from infinijup.store.checkout import checkout_dir

    nb = notebook
    digest, snap = await _snapshot_then_move_on(nb, seed=63)
    root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    work = Path(tempfile.mkdtemp())
    try:
        with Repository.open(Path(store_path)) as repo:
            commit = repo.get_commit(snap["commit"])
            checkout_dir(repo, snap["commit"], work / "images")
            pages = max((work / "images").glob("pages-*.img"), key=lambda p: p.stat().st_size)
            os.truncate(pages, pages.stat().st_size // 2)
            damaged = repo.commit_dir(
                work / "images", message="damaged",
                thread=store_thread(notebook_key(nb.path), "damaged"),
                metadata={**commit.metadata, "thread": "damaged"})
    finally:
        shutil.rmtree(work)
    before = store_state(store_path)
    r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": damaged.id})
    assert r.code == 500, r.body
    body = json.loads(r.body)
    assert body["reason"] == "bad_request" and "damaged images" in body["message"], body
    assert pages.name in body["message"], body
    assert provisioner(jp_serverapp, nb.kernel_id).root_pid == root
    await state_intact(nb, digest, {"x": "current"})
    assert store_state(store_path) == before
    assert_store_ok(store_path)
    assert rhelper.staging_entries() == []
    await nb.restore(snap["commit"])
    await state_intact(nb, digest, {"x": "snapshotted"})


async def test_restore_that_criu_refuses(notebook, jp_serverapp, rhelper, store_path):
    """CRIU fails after the old kernel was replaced: a directory the snapshot's kernel had open
    has another mode since (an absent file is refused before the kill: host_files.py; a
    directory's mode is left to CRIU). The kernel is restarted fresh, the reason is shown, and
    every snapshot is still there: once the mode is back, the same snapshot restores."""
    nb = notebook
    data = Path(tempfile.mkdtemp(prefix="ij-open-")) / "data.txt"
    data.write_text("".join(f"line {i}\n" for i in range(100)))
    digest = await fill(nb, 100, seed=64)
    await nb.execute(f"fh = open({str(data)!r}); first = fh.readline()\nx = 'snapshotted'\n"
                     f"import os; dfd = os.open({str(data.parent)!r}, os.O_RDONLY)")
    snap = await nb.snapshot(message="holds a file open")
    await nb.execute("x = 'current'")
    old_root = provisioner(jp_serverapp, nb.kernel_id).root_pid
    saved = os.stat(data.parent).st_mode & 0o7777
    os.chmod(data.parent, saved ^ 0o055)
    before = store_state(store_path)
    try:
        r = await nb.post("restore", {"kernel_id": nb.kernel_id, "commit": snap["commit"]})
        assert r.code == 500, r.body
        body = json.loads(r.body)
        assert body["reason"] == "criu_failed", body
        assert "CRIU restore failed" in body["message"] and data.parent.name in body["message"], body
        assert "restarted fresh; every snapshot is intact" in body["message"], body
        print(f"CRIU refused: {body['message'][:1500]}")
        await wait_restarted(nb, jp_serverapp, old_root)
        assert await nb.value("globals().get('x')") is None  # a fresh kernel
        assert store_state(store_path) == before
        assert_store_ok(store_path)
        assert rhelper.staging_entries() == []
        assert rhelper.user_entries() == {"images": [], "restore": []}
        os.chmod(data.parent, saved)
        await nb.restore(snap["commit"])
        await state_intact(nb, digest, {"x": "snapshotted", "fh.readline()": "line 1\n"})
    finally:
        shutil.rmtree(data.parent)
