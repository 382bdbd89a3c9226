"""The hot tier (infinijup/engine/hot_tier.py): recent images kept ready beside the store.

First the tier itself, on a real store and real files: what it keeps, that a restore's links
leave it intact, that it refuses images that no longer match their commit, and eviction (least
recently used first, within the budget and the filesystem's free space). Then through the real
server, helper and CRIU: a restore of a recent snapshot takes its images from the tier, twice;
a snapshot the tier does not hold, or holds damaged, restores from the store.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from kernelkit import needs_helper

from infinijup.engine import hot_tier as hot_tier_module
from infinijup.engine.hot_tier import HotTier, default_budget
from infinijup.store import Repository

MiB = 1 << 20


@pytest.fixture
def repo(tmp_path):
    with Repository.open_or_init(tmp_path / "store") as r:
        yield r


def dump_like(where: Path, seed: int, mib: int = 1) -> Path:
    """A directory shaped like a CRIU images dir: a few metadata files and a pages file."""
    where.mkdir(mode=0o700)
    (where / "inventory.img").write_bytes(b"inv%d" % seed)
    (where / "pstree.img").write_bytes(b"tree%d" % seed)
    (where / "pages-1.img").write_bytes(os.urandom(mib * MiB))
    return where


def committed(repo, tmp_path: Path, seed: int, mib: int = 1):
    images = dump_like(tmp_path / f"images-{seed}", seed, mib)
    commit = repo.commit_dir(images, thread="t", message=str(seed), parents=[])
    return images, commit, repo.get_tree(commit.tree)


def test_default_budget_is_a_quarter_of_memory_at_most_32_gib():
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_budget() == min(ram // 4, 32 << 30)


def test_kept_images_restore_by_links_and_survive_the_restore(repo, tmp_path):
    hot = HotTier(tmp_path / "work" / "hot", 64 * MiB)
    images, commit, tree = committed(repo, tmp_path, 1)
    pages = (images / "pages-1.img").read_bytes()
    assert hot.keep(images, commit, tree)
    assert not images.exists()  # moved, not copied
    assert [e.commit for e in hot.entries()] == [commit.id]

    for n in range(2):
        target = tmp_path / "work" / f"restore-{n}"
        assert hot.link_into(commit, tree, target)
        assert sorted(os.listdir(target)) == ["inventory.img", "pages-1.img", "pstree.img"]
        assert (target / "pages-1.img").read_bytes() == pages
        assert os.stat(target / "pages-1.img").st_ino == \
            os.stat(hot.root / commit.id / "pages-1.img").st_ino  # a link, no copy
        shutil.rmtree(target)  # what the engine does once the helper has restored
        assert (hot.root / commit.id / "pages-1.img").read_bytes() == pages


def test_another_commit_is_not_served(repo, tmp_path):
    hot = HotTier(tmp_path / "hot", 64 * MiB)
    images, commit, tree = committed(repo, tmp_path, 1)
    _other_images, other, other_tree = committed(repo, tmp_path, 2)
    assert hot.keep(images, commit, tree)
    assert not hot.link_into(other, other_tree, tmp_path / "r")
    assert not (tmp_path / "r").exists()
    assert [e.commit for e in hot.entries()] == [commit.id]  # still there for its own commit


@pytest.mark.parametrize("damage", ["rewritten", "truncated", "removed", "manifest"])
def test_images_that_no_longer_match_their_commit_are_dropped(repo, tmp_path, damage):
    hot = HotTier(tmp_path / "hot", 64 * MiB)
    images, commit, tree = committed(repo, tmp_path, 1)
    assert hot.keep(images, commit, tree)
    pages = hot.root / commit.id / "pages-1.img"
    if damage == "rewritten":  # same size, other bytes (its modification time moves)
        with open(pages, "r+b") as f:
            f.write(b"X")
        os.utime(pages, ns=(0, pages.stat().st_mtime_ns + 10**9))
    elif damage == "truncated":
        os.truncate(pages, 4096)
    elif damage == "removed":
        pages.unlink()
    else:  # a manifest claiming other blobs than the commit's tree
        manifest = json.loads((hot.root / f"{commit.id}.json").read_text())
        manifest["files"]["pages-1.img"][0] = "0" * 64
        (hot.root / f"{commit.id}.json").write_text(json.dumps(manifest))
    target = tmp_path / "restore"
    assert not hot.link_into(commit, tree, target)
    assert not target.exists()
    assert hot.entries() == [] and not (hot.root / commit.id).exists()


def test_least_recently_used_goes_first(repo, tmp_path):
    kept = []
    for seed in (1, 2, 3):
        kept.append(committed(repo, tmp_path, seed))
    one = max(e.size for _i, _c, tree in kept for e in tree) + 64 * 1024
    hot = HotTier(tmp_path / "hot", 2 * one)  # room for two
    (a_images, a, a_tree), (b_images, b, b_tree), (c_images, c, c_tree) = kept
    assert hot.keep(a_images, a, a_tree) and hot.keep(b_images, b, b_tree)
    target = tmp_path / "restore"
    assert hot.link_into(a, a_tree, target)  # a is used again: b is now the oldest
    shutil.rmtree(target)
    assert hot.keep(c_images, c, c_tree)
    assert {e.commit for e in hot.entries()} == {a.id, c.id}
    assert sum(e.bytes for e in hot.entries()) <= hot.budget


def test_images_larger_than_the_budget_stay_out(repo, tmp_path):
    images, commit, tree = committed(repo, tmp_path, 1, mib=2)
    assert not HotTier(tmp_path / "hot", MiB).keep(images, commit, tree)
    assert images.is_dir()  # left to the engine, which removes it
    assert not HotTier(tmp_path / "off", 0).keep(images, commit, tree)


def test_the_next_dump_gets_room(repo, tmp_path, monkeypatch):
    hot = HotTier(tmp_path / "hot", 64 * MiB)
    for seed in (1, 2):
        images, commit, tree = committed(repo, tmp_path, seed)
        assert hot.keep(images, commit, tree)
    newest = max(e.bytes for e in hot.entries())
    # the filesystem has less free space than an image as large as the newest: the oldest goes
    free = {"bytes": newest - 1}
    monkeypatch.setattr(hot_tier_module, "_free", lambda path: free["bytes"])

    def drop_one_then_enough(commit_id: str, real=hot._drop_locked) -> None:
        real(commit_id)
        free["bytes"] += newest

    monkeypatch.setattr(hot, "_drop_locked", drop_one_then_enough)
    hot.make_room()
    assert [e.commit for e in hot.entries()] == [commit.id]


def test_room_for_an_entry_counts_what_older_entries_would_give_back(repo, tmp_path,
                                                                     monkeypatch):
    hot = HotTier(tmp_path / "hot", 64 * MiB)
    assert hot.room_for(MiB)  # no tier directory yet: the work dir's filesystem
    images, commit, tree = committed(repo, tmp_path, 1)
    assert hot.keep(images, commit, tree)
    held = sum(e.bytes for e in hot.entries())
    monkeypatch.setattr(hot_tier_module, "_free", lambda path: 10 * MiB)
    assert hot.room_for(10 * MiB + held)  # the older entry would give way
    assert not hot.room_for(10 * MiB + held + 1)
    assert hot.room_for(6 * MiB, writing=4 * MiB)  # a copy still to write takes free space
    assert not hot.room_for(8 * MiB + held, writing=4 * MiB)
    assert not hot.room_for(65 * MiB)  # past the budget
    assert not HotTier(tmp_path / "off", 0).room_for(1)


def test_half_kept_entries_are_swept(repo, tmp_path):
    hot = HotTier(tmp_path / "hot", 64 * MiB)
    hot.root.mkdir()
    (hot.root / ("a" * 64)).mkdir()  # a server killed between the rename and the manifest
    (hot.root / ("b" * 64 + ".json")).write_text("{}")
    (hot.root / ".cafe.json.123.tmp").write_text("{")
    images, commit, tree = committed(repo, tmp_path, 1)
    assert hot.keep(images, commit, tree)
    assert sorted(os.listdir(hot.root)) == sorted([".lock", commit.id, f"{commit.id}.json"])


# --- through the real server, helper and CRIU ------------------------------------------------
def _hot_dir(helper_daemon) -> Path:
    return Path(helper_daemon.work_dir) / str(os.getuid()) / "hot"


@needs_helper
@pytest.mark.timeout(240)
async def test_a_recent_snapshot_restores_from_the_hot_tier(notebook, helper_daemon):
    nb = notebook
    await nb.execute("import os; x = 'snapshotted'; blob = os.urandom(20 << 20)")
    digest = await nb.value("__import__('hashlib').sha256(blob).hexdigest()")
    snap = await nb.snapshot(message="hot")
    assert snap["stats"]["hot"] is True, snap
    assert (_hot_dir(helper_daemon) / snap["commit"]).is_dir()
    for _ in range(2):  # the first restore leaves the hot copy intact for the next
        await nb.execute("x = 'moved on'; blob = b''")
        r = await nb.restore(snap["commit"])
        assert r["phases"]["images"] == "hot", r
        assert await nb.value("x") == "snapshotted"
        assert await nb.value("__import__('hashlib').sha256(blob).hexdigest()") == digest
    user = Path(helper_daemon.work_dir) / str(os.getuid())
    for kind in ("images", "restore"):
        assert not (user / kind).is_dir() or os.listdir(user / kind) == []


@needs_helper
@pytest.mark.timeout(240)
async def test_without_a_hot_copy_the_store_serves(notebook, jp_serverapp, helper_daemon):
    nb = notebook
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    await nb.execute("x = 'first'")
    first = await nb.snapshot(message="damaged hot copy")
    # a hot copy that no longer matches its commit: not used, dropped
    entry = _hot_dir(helper_daemon) / first["commit"]
    pages = max(entry.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    os.truncate(pages, pages.stat().st_size // 2)
    await nb.execute("x = 'moved on'")
    r = await nb.restore(first["commit"])
    assert r["phases"]["images"] == "store", r
    assert await nb.value("x") == "first"
    assert not entry.exists()
    # a tier too small for any image keeps nothing: the store serves
    manager.hot_tier_bytes = 1
    await nb.execute("x = 'second'")
    second = await nb.snapshot(message="not kept")
    assert second["stats"]["hot"] is False
    assert not (_hot_dir(helper_daemon) / second["commit"]).exists()
    await nb.execute("x = 'moved on'")
    r = await nb.restore(second["commit"])
    assert r["phases"]["images"] == "store", r
    assert await nb.value("x") == "second"
