"""Thinned commits (store/thinned.py): an automatic snapshot whose images are let go keeps its
place in the history (its commit file, its children), gc gives its bytes back, check is clean,
and a checkout of it is refused with the reason; what it shares with a kept commit stays."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import random_bytes

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.gc import gc
from infinijup.store.thinned import CommitThinned, mark_thinned, thinned


def snap(repo: Repository, tmp_path: Path, seed: int, shared: bytes = b""):
    src = tmp_path / f"src-{seed}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(random_bytes(400_000, seed=seed))
    if shared:
        (src / "pages-2.img").write_bytes(shared)
    return repo.commit_dir(src, thread="main", message=f"s{seed}")


def test_a_thinned_commit_stays_in_the_history_and_its_bytes_go(repo, tmp_path):
    shared = random_bytes(200_000, seed=99)
    a = snap(repo, tmp_path, 1, shared)
    b = snap(repo, tmp_path, 2, shared)  # the middle one: c builds on it
    c = snap(repo, tmp_path, 3, shared)
    packs_before = repo.stats()["pack_bytes"]
    mark_thinned(repo, [b.id])
    assert set(thinned(repo)) == {b.id}
    report = gc(repo)
    assert report.commits_removed == []  # the commit file stays
    # b's own 400 kB are gone; the 200 kB it shares with a and c are not
    assert repo.stats()["pack_bytes"] <= packs_before - 350_000
    assert repo.get_commit(c.id).parents == (b.id,)
    assert [x.id for x in repo.log("main")][:3] == [c.id, b.id, a.id]
    assert check(repo, read_data=True).ok
    with pytest.raises(CommitThinned) as err:
        checkout_dir(repo, b.id, tmp_path / "out-b")
    assert "was thinned" in str(err.value) and err.value.reason == "commit_thinned"
    for kept in (a, c):  # whole, the shared file too
        out = tmp_path / f"out-{kept.id[:6]}"
        checkout_dir(repo, kept.id, out)
        assert (out / "pages-2.img").read_bytes() == shared


def test_thinning_twice_keeps_the_first_time(repo, tmp_path):
    a = snap(repo, tmp_path, 1)
    mark_thinned(repo, [a.id])
    first = thinned(repo)[a.id]
    mark_thinned(repo, [a.id])
    assert thinned(repo)[a.id] == first
