"""Deleting snapshots and threads (store/space.py): a tip goes and its thread moves back, a
snapshot others build on is refused, a thread goes with what only it reached, what a kernel
stands on is refused, and gc really gives the bytes back; the hot tier's copies of deleted
snapshots are pruned (store/hot_dir.py); the command line does all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import random_bytes, subprocess_env

from infinijup.store import Repository, hot_dir
from infinijup.store.errors import InvalidRef, RefConflict, UnknownRef
from infinijup.store.space import (
    DeleteRefused,
    delete,
    format_bytes,
    plan_commit_delete,
    plan_thread_delete,
    store_bytes,
)

INFINIJUP = Path(sys.executable).parent / "infinijup"


def snap(repo: Repository, tmp_path: Path, seed: int, thread: str = "main",
         parents: list[str] | None = None, size: int = 400_000):
    """A commit of its own random bytes (nothing shared with the others: each frees bytes)."""
    src = tmp_path / f"src-{seed}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(random_bytes(size, seed=seed))
    return repo.commit_dir(src, thread=thread, message=f"s{seed}", parents=parents)


def test_deleting_a_tip_moves_its_thread_back_and_gc_gives_the_bytes_back(repo, tmp_path):
    a = snap(repo, tmp_path, 1)
    b = snap(repo, tmp_path, 2)
    packs_before = repo.stats()["pack_bytes"]
    plan = plan_commit_delete(repo, b.id[:10])
    assert plan.moves == {"main": a.id} and plan.removed == (b.id,)
    report = delete(repo, plan)
    assert repo.threads() == {"main": a.id}
    assert report.gc is not None and report.gc.commits_removed == [b.id]
    stats = repo.stats()
    assert stats["commits"] == 1
    # b's 400 kB of random bytes are gone from the packs (repacked or deleted)
    assert stats["pack_bytes"] <= packs_before - 350_000, (packs_before, stats["pack_bytes"])
    assert report.store_bytes_after < report.store_bytes_before
    with pytest.raises(UnknownRef):
        repo.get_commit(b.id)
    assert repo.get_commit("main").id == a.id  # what stays is intact


def test_a_snapshot_with_children_is_refused_and_nothing_changes(repo, tmp_path):
    a = snap(repo, tmp_path, 1)
    b = snap(repo, tmp_path, 2)
    with pytest.raises(DeleteRefused) as err:
        plan_commit_delete(repo, a.id)
    assert err.value.http_status == 409 and err.value.reason == "snapshot_has_children"
    assert b.id[:12] in str(err.value)
    assert repo.threads() == {"main": b.id}
    # a child on another thread counts too
    c = snap(repo, tmp_path, 3, thread="side", parents=[b.id])
    with pytest.raises(DeleteRefused, match=c.id[:12]):
        plan_commit_delete(repo, b.id)


def test_deleting_a_first_snapshot_removes_its_thread(repo, tmp_path):
    a = snap(repo, tmp_path, 1)
    delete(repo, plan_commit_delete(repo, a.id))
    assert repo.threads() == {}
    assert repo.stats()["commits"] == 0 and repo.stats()["pack_bytes"] == 0


def test_deleting_a_thread_keeps_what_another_thread_reaches(repo, tmp_path):
    a = snap(repo, tmp_path, 1)
    b = snap(repo, tmp_path, 2)
    c = snap(repo, tmp_path, 3, thread="side", parents=[a.id])
    d = snap(repo, tmp_path, 4, thread="side")
    plan = plan_thread_delete(repo, "side")
    assert set(plan.removed) == {c.id, d.id}
    report = delete(repo, plan)
    assert repo.threads() == {"main": b.id}
    assert sorted(report.gc.commits_removed) == sorted([c.id, d.id])
    assert [x.id for x in repo.log("main")] == [b.id, a.id]
    with pytest.raises(UnknownRef):
        plan_thread_delete(repo, "side")


def test_what_a_kernel_stands_on_is_refused(repo, tmp_path):
    a = snap(repo, tmp_path, 1)
    b = snap(repo, tmp_path, 2)
    needed = {b.id: "the snapshot hibernated kernel k1 sleeps in"}
    with pytest.raises(DeleteRefused, match="hibernated kernel k1") as err:
        plan_commit_delete(repo, b.id, needed=needed)
    assert err.value.reason == "snapshot_in_use"
    with pytest.raises(DeleteRefused, match="hibernated kernel k1"):
        plan_thread_delete(repo, "main", needed=needed)
    # a kernel standing on the middle of a thread keeps the thread, not the tip
    needed = {a.id: "the HEAD of kernel k2"}
    with pytest.raises(DeleteRefused, match="HEAD of kernel k2"):
        plan_thread_delete(repo, "main", needed=needed)
    delete(repo, plan_commit_delete(repo, b.id, needed=needed), needed=needed)
    assert repo.threads() == {"main": a.id}


def test_gc_keeps_what_the_caller_needs_though_no_thread_reaches_it(repo, tmp_path):
    a = snap(repo, tmp_path, 1)
    b = snap(repo, tmp_path, 2, thread="other", parents=[])
    repo.delete_thread("other")
    report = delete(repo, plan_commit_delete(repo, a.id), needed={b.id})
    assert report.gc.commits_removed == [a.id]
    assert repo.get_commit(b.id).id == b.id


def test_a_tip_shared_with_a_thread_not_given_is_refused(repo, tmp_path):
    snap(repo, tmp_path, 1)
    b = snap(repo, tmp_path, 2)
    repo.set_thread("nb-other--main", b.id)
    with pytest.raises(DeleteRefused, match="nb-other--main"):
        plan_commit_delete(repo, b.id, threads={"main"})
    plan = plan_commit_delete(repo, b.id)  # the store's own rule: both move back
    assert set(plan.moves) == {"main", "nb-other--main"}


def test_a_thread_that_moved_since_the_plan_is_left_alone(repo, tmp_path):
    snap(repo, tmp_path, 1)
    b = snap(repo, tmp_path, 2)
    plan = plan_commit_delete(repo, b.id)
    c = snap(repo, tmp_path, 3)
    with pytest.raises(RefConflict):
        delete(repo, plan)
    assert repo.threads() == {"main": c.id}
    assert repo.get_commit(b.id).id == b.id


def test_a_thread_name_is_not_a_snapshot_id(repo, tmp_path):
    snap(repo, tmp_path, 1)
    with pytest.raises(InvalidRef, match="delete the thread"):
        plan_commit_delete(repo, "main")


def test_sizes_in_decimal_units():
    assert format_bytes(45_000_000) == "45 MB"
    assert format_bytes(2_700_000_000) == "2.7 GB"
    assert format_bytes(120_000_000) == "0.1 GB"
    assert format_bytes(1_640_000) == "1.6 MB"
    assert format_bytes(5_300) == "5 kB"
    assert format_bytes(12) == "12 B"


def test_store_bytes_counts_what_is_on_disk(repo, tmp_path):
    empty = store_bytes(repo)
    snap(repo, tmp_path, 1, size=2_000_000)
    assert store_bytes(repo) >= empty + 2_000_000


# --- the hot tier's directory ------------------------------------------------------------

def hot_entry(root: Path, commit_id: str, size: int, used: float,
              store: str | None = None) -> None:
    (root / commit_id).mkdir(parents=True)
    (root / commit_id / "pages-1.img").write_bytes(os.urandom(size))
    (root / f"{commit_id}.json").write_text(json.dumps({"commit": commit_id, "bytes": size,
                                                        "used": used, "store": store}))


def test_hot_dir_prune_drops_what_it_is_told_and_measures(tmp_path):
    root = tmp_path / "hot"
    hot_entry(root, "a" * 64, 100_000, 1.0)
    hot_entry(root, "b" * 64, 200_000, 2.0)
    assert [e.commit for e in hot_dir.entries(root)] == ["a" * 64, "b" * 64]
    assert hot_dir.usage(root) >= 300_000
    dropped = hot_dir.prune(root, lambda e: e.commit != "a" * 64)
    assert [e.commit for e in dropped] == ["a" * 64]
    assert not (root / ("a" * 64)).exists() and not (root / f"{'a' * 64}.json").exists()
    assert [e.commit for e in hot_dir.entries(root)] == ["b" * 64]
    assert 200_000 <= hot_dir.usage(root) < 300_000
    assert hot_dir.prune(tmp_path / "absent", lambda e: False) == []
    assert hot_dir.usage(tmp_path / "absent") == 0


# --- the command line -------------------------------------------------------------------

def cli(store: Path, *args: str, hot: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = subprocess_env(INFINIJUP_HOT_TIER=str(hot or store.parent / "no-hot"))
    return subprocess.run([str(INFINIJUP), "store", "--store", str(store), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_rm_thread_rm_and_stats(tmp_path):
    store = tmp_path / "store"
    with Repository.init(store) as repo:
        a = snap(repo, tmp_path, 1)
        b = snap(repo, tmp_path, 2)
        c = snap(repo, tmp_path, 3, thread="side", parents=[a.id])
        store_id = repo.config.id
    hot = tmp_path / "hot"
    hot_entry(hot, b.id, 1_500_000, 1.0, store_id)
    hot_entry(hot, a.id, 100_000, 2.0, store_id)

    r = cli(store, "stats", hot=hot)
    assert r.returncode == 0, r.stderr
    assert "hot copies" in r.stdout and "1.6 MB" in r.stdout, r.stdout
    assert "store" in r.stdout

    r = cli(store, "rm", a.id[:12], hot=hot)
    assert r.returncode == 2 and "build on it" in r.stderr and "snapshot_has_children" in r.stderr, r

    r = cli(store, "rm", b.id[:12], hot=hot)
    assert r.returncode == 0, r.stderr
    assert "main" in r.stdout and a.id[:12] in r.stdout, r.stdout
    assert "1 hot cop" in r.stdout, r.stdout
    assert [e.commit for e in hot_dir.entries(hot)] == [a.id]

    # a hibernated kernel's record beside the store protects its snapshot
    records = tmp_path / "store-hibernated"
    records.mkdir()
    (records / "k1.json").write_text(json.dumps({"kernel_id": "k1", "path": "a.ipynb",
                                                 "commit": c.id, "since": 1.0}))
    r = cli(store, "thread-rm", "side")
    assert r.returncode == 2 and "hibernated" in r.stderr, r
    (records / "k1.json").unlink()
    r = cli(store, "thread-rm", "side")
    assert r.returncode == 0, r.stderr
    with Repository.open(store) as repo:
        assert repo.threads() == {"main": a.id}
        assert repo.stats()["commits"] == 1


def test_a_prune_judges_only_its_own_stores_hot_copies(tmp_path):
    """The hot tier is one per user; a user's servers may use other stores. A copy kept for
    another store is never dropped as "gone from the store" (a CI run dropped 27 of them)."""
    root = tmp_path / "hot"
    for commit, store in (("a" * 64, "ours"), ("b" * 64, "theirs"), ("c" * 64, None)):
        (root / commit).mkdir(parents=True)
        (root / commit / "pages.img").write_bytes(b"x" * 10)
        (root / f"{commit}.json").write_text(json.dumps(
            {"commit": commit, "used": 1.0, "bytes": 10, "store": store}))
    in_our_store: set[str] = set()  # none of them: all "gone" from our store
    dropped = hot_dir.prune(root, lambda e: e.store != "ours" or e.commit in in_our_store)
    assert [e.commit for e in dropped] == ["a" * 64]
    assert sorted(e.commit for e in hot_dir.entries(root)) == ["b" * 64, "c" * 64]
