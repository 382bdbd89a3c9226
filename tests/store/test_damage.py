"""Damaged stores: each failure has its own clear error and check names what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import random_bytes

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.errors import (
    ChecksumMismatch,
    CorruptObject,
    IndexCorrupt,
    ObjectMissing,
    UnknownRef,
)
from infinijup.store.gc import gc
from infinijup.store.layout import pack_files
from infinijup.store.rebuild import rebuild_index


def two_commits(repo: Repository, tmp_path: Path) -> tuple[str, str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.img").write_bytes(random_bytes(1_500_000, seed=1))
    a = repo.commit_dir(src, thread="a")
    (src / "a.img").unlink()
    (src / "b.img").write_bytes(random_bytes(1_500_000, seed=2))
    b = repo.commit_dir(src, thread="b")
    return a.id, b.id, src


def chunk_of(repo: Repository, commit_id: str, name: str) -> bytes:
    entry = next(e for e in repo.get_tree(repo.get_commit(commit_id).tree) if e.name == name)
    return repo.get_blob_chunks(entry.id)[1][0]


def test_flipped_byte_is_named_and_isolated(repo: Repository, tmp_path: Path) -> None:
    a, b, _ = two_commits(repo, tmp_path)
    victim = chunk_of(repo, a, "a.img")
    loc = repo.index.lookup(victim)
    assert loc is not None
    path = pack_files(repo)[loc.pack]
    with open(path, "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    assert check(repo).ok  # structure is intact: only reading the data finds it
    report = check(repo, read_data=True)
    assert not report.ok
    assert any(victim.hex() in p and loc.pack in p for p in report.problems), report.problems
    with pytest.raises(ChecksumMismatch) as err:
        repo.read_object(victim)
    assert victim.hex() in str(err.value) and loc.pack in str(err.value)
    with pytest.raises(ChecksumMismatch):
        checkout_dir(repo, a, tmp_path / "out-a")
    assert not (tmp_path / "out-a").exists()
    checkout_dir(repo, b, tmp_path / "out-b")  # the other commit still reads
    assert (tmp_path / "out-b" / "b.img").read_bytes() == random_bytes(1_500_000, seed=2)


def test_truncated_pack(repo: Repository, tmp_path: Path) -> None:
    a, b, _ = two_commits(repo, tmp_path)
    victim = chunk_of(repo, a, "a.img")
    loc = repo.index.lookup(victim)
    assert loc is not None
    path = pack_files(repo)[loc.pack]
    os.truncate(path, path.stat().st_size - 100)
    report = check(repo)
    assert any(loc.pack in p and "trailer" in p for p in report.problems), report.problems
    # objects before the cut are intact and the index still locates them
    assert repo.read_object(victim)
    os.truncate(path, loc.offset + 10)  # cut inside an object
    with pytest.raises(ChecksumMismatch, match="short read|decompress|checksum"):
        repo.read_object(victim)
    with pytest.raises(ChecksumMismatch):
        checkout_dir(repo, a, tmp_path / "out")


def test_missing_index_is_rebuilt(repo: Repository, tmp_path: Path) -> None:
    a, b, _ = two_commits(repo, tmp_path)
    before = {c.id for c in repo.log()}
    repo.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(repo.index_path) + suffix).unlink(missing_ok=True)
    again = Repository.open(repo.path)
    assert {c.id for c in again.log()} == before
    assert check(again, read_data=True).ok
    checkout_dir(again, a, tmp_path / "out")


def test_corrupt_index_needs_rebuild(repo: Repository, tmp_path: Path) -> None:
    a, b, _ = two_commits(repo, tmp_path)
    repo.close()
    for suffix in ("-wal", "-shm"):
        Path(str(repo.index_path) + suffix).unlink(missing_ok=True)
    repo.index_path.write_bytes(b"this is not sqlite" * 100)
    broken = Repository.open(repo.path)
    with pytest.raises(IndexCorrupt) as err:
        broken.log()
    assert "rebuild-index" in str(err.value)
    summary = rebuild_index(broken)
    assert summary["commits"] == 2
    assert broken.resolve(a[:8]) == a
    assert check(broken, read_data=True).ok


def test_stale_index_rows_are_found_and_repaired(repo: Repository, tmp_path: Path) -> None:
    a, b, _ = two_commits(repo, tmp_path)
    victim = chunk_of(repo, b, "b.img")
    repo.index._db.execute("DELETE FROM objects WHERE id = ?", (victim,))
    report = check(repo)
    assert any(victim.hex() in p and "missing" in p for p in report.problems)
    with pytest.raises(ObjectMissing):
        checkout_dir(repo, b, tmp_path / "out")
    with pytest.raises(Exception, match="gc refused"):
        gc(repo)
    rebuild_index(repo)
    assert check(repo).ok


def test_ref_to_missing_commit(repo: Repository, tmp_path: Path) -> None:
    a, b, _ = two_commits(repo, tmp_path)
    (repo.commits_dir / b[:2] / b).unlink()
    report = check(repo)
    assert any("thread 'b'" in p and b in p for p in report.problems), report.problems
    with pytest.raises(ObjectMissing):
        repo.get_commit("b")
    assert repo.get_commit("a").id == a


def test_damaged_commit_and_ref_files(repo: Repository, tmp_path: Path) -> None:
    a, b, _ = two_commits(repo, tmp_path)
    p = repo.commits_dir / a[:2] / a
    p.write_bytes(p.read_bytes().replace(b'"thread":"a"', b'"thread":"z"'))
    with pytest.raises(ChecksumMismatch):
        repo.get_commit(a)
    assert any(a in x and "checksum" in x for x in check(repo).problems)
    (repo.refs_dir / "b").write_text("garbage\n")
    with pytest.raises(CorruptObject):
        repo.resolve("b")


def test_unknown_ref_errors(repo: Repository) -> None:
    with pytest.raises(UnknownRef, match="no thread or commit named 'main'"):
        repo.get_commit("main")
    with pytest.raises(UnknownRef):
        repo.log("main")
