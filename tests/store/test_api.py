"""Round trips and the public API contract of the store."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
from conftest import page_image, random_bytes

from infinijup.errors import BadRequest, Conflict, NotFound
from infinijup.store import (
    Blob,
    Commit,
    Dir,
    File,
    Repository,
    Symlink,
    default_store_path,
)
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.errors import (
    AmbiguousRef,
    CheckoutTargetNotEmpty,
    InvalidRef,
    ObjectMissing,
    RefConflict,
    StoreExists,
    StoreNotFound,
    UnknownRef,
    UnsupportedFormat,
)
from infinijup.store.gc import gc
from infinijup.store.rebuild import rebuild_index


def make_tree(root: Path) -> None:
    """A directory with the awkward cases: empty files, nesting, modes, symlink, holes."""
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "empty").write_bytes(b"")
    (root / "small.txt").write_text("hello\n")
    (root / "pages-1.img").write_bytes(page_image(300, seed=1))
    (root / "sub" / "random.bin").write_bytes(random_bytes(200_000, seed=2))
    (root / "sub" / "deeper" / "exec.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "sub" / "deeper" / "exec.sh", 0o755)
    os.chmod(root / "small.txt", 0o600)
    os.chmod(root / "sub", 0o750)
    os.symlink("small.txt", root / "link")
    with open(root / "sparse.img", "wb") as f:  # 3 MiB of zeros with data in the middle
        f.truncate(3 << 20)
        f.seek(1 << 20)
        f.write(random_bytes(10_000, seed=3))


def assert_same_tree(a: Path, b: Path) -> None:
    names_a = sorted(os.listdir(a))
    assert names_a == sorted(os.listdir(b))
    for name in names_a:
        pa, pb = a / name, b / name
        sa, sb = os.lstat(pa), os.lstat(pb)
        assert stat.S_IFMT(sa.st_mode) == stat.S_IFMT(sb.st_mode), name
        if stat.S_ISLNK(sa.st_mode):
            assert os.readlink(pa) == os.readlink(pb)
            continue
        assert stat.S_IMODE(sa.st_mode) == stat.S_IMODE(sb.st_mode), name
        if stat.S_ISDIR(sa.st_mode):
            assert_same_tree(pa, pb)
        else:
            assert pa.read_bytes() == pb.read_bytes(), name


def test_commit_dir_checkout_roundtrip(any_repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    c = any_repo.commit_dir(src, thread="main", message="first", metadata={"k": 1})
    assert isinstance(c, Commit) and len(c.id) == 64 and c.parents == ()
    assert c.thread == "main" and c.message == "first" and c.metadata == {"k": 1}
    logical = sum(p.stat().st_size for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    assert c.stats["image_bytes"] == logical
    assert c.stats["files"] == 6
    assert 0 < c.stats["stored_bytes"] < logical  # zeros dedup, structured pages compress
    out = tmp_path / "out"
    checkout_dir(any_repo, c.id, out)
    assert_same_tree(src, out)
    # zero runs come back as holes
    assert os.stat(out / "sparse.img").st_blocks * 512 < (3 << 20)
    # into an existing empty directory works as well
    (tmp_path / "out2").mkdir()
    checkout_dir(any_repo, "main", tmp_path / "out2")
    assert_same_tree(src, tmp_path / "out2")


def test_checkout_refuses_non_empty_target(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    repo.commit_dir(src, thread="t")
    with pytest.raises(CheckoutTargetNotEmpty) as err:
        checkout_dir(repo, "t", src)
    assert isinstance(err.value, BadRequest)
    assert (src / "f").read_bytes() == b"x"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_second_commit_is_identical_and_free(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    c1 = repo.commit_dir(src, thread="main")
    c2 = repo.commit_dir(src, thread="main")
    assert c2.parents == (c1.id,)
    assert c2.tree == c1.tree
    assert c2.stats["new_chunks"] == 0
    assert c2.stats["stored_bytes"] < 100  # nothing but the pack header... or nothing
    assert repo.threads() == {"main": c2.id}


@pytest.mark.parametrize("where", ["scattered-runs", "insert-middle"])
def test_dedup_after_one_percent_change(any_repo: Repository, tmp_path: Path,
                                        where: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    n_pages = 2048  # 8 MiB
    img = page_image(n_pages, seed=5)
    (src / "pages-1.img").write_bytes(img)
    any_repo.commit_dir(src, thread="main")
    if where == "scattered-runs":  # 1% of the pages, dirtied in 4 runs of 5 pages
        for run in range(4):
            first = 100 + run * 500
            for p in range(first, first + 5):
                img[p * 4096 + 100 : p * 4096 + 108] = b"DIRTY!!!"
    else:  # 1% new pages inserted in the middle: every later offset shifts
        img[1000 * 4096 : 1000 * 4096] = random_bytes(20 * 4096, seed=6)
    (src / "pages-1.img").write_bytes(img)
    c2 = any_repo.commit_dir(src, thread="main")
    ratio = c2.stats["stored_bytes"] / c2.stats["image_bytes"]
    if any_repo.config.chunker.algorithm == "fixed" and where == "insert-middle":
        assert ratio > 0.2  # fixed chunks cannot follow a shift: that is why CDC is default
    else:
        assert ratio < 0.03, ratio
    out = tmp_path / "out"
    checkout_dir(any_repo, c2.id, out)
    assert (out / "pages-1.img").read_bytes() == bytes(img)


def test_streaming_writer_and_commit_tree(repo: Repository, tmp_path: Path) -> None:
    data = random_bytes(3_000_000, seed=7)
    with repo.writer() as w:
        b1 = w.add_stream(io.BytesIO(data))
        b2 = w.add_stream(iter([data[:10], data[10:1_000_001], data[1_000_001:]]))
        b3 = w.add_bytes(b"")
        assert b1 == b2 and b1.size == len(data)
        c = w.commit(
            {"a.img": b1, "x": File(b3, 0o600), "d": Dir({"b.img": b2, "l": Symlink("../a")},
                                                        0o700), "n": {"e": b3}},
            thread="s", message="streamed", metadata={"notebook_path": "nb.ipynb"})
    assert c.stats["image_bytes"] == 2 * len(data)
    assert c.stats["chunks"] > 0
    assert repo.read_blob(b1.id) == data
    out = tmp_path / "out"
    checkout_dir(repo, "s", out)
    assert (out / "a.img").read_bytes() == data
    assert (out / "d" / "b.img").read_bytes() == data
    assert os.readlink(out / "d" / "l") == "../a"
    assert stat.S_IMODE(os.stat(out / "d").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(out / "n").st_mode) == 0o755
    assert (out / "n" / "e").read_bytes() == b""
    # a standalone commit_tree reusing stored blobs
    c2 = repo.commit_tree({"again.img": b1}, thread="s2")
    assert repo.read_blob(repo.get_tree(c2.tree)[0].id) == data


def test_commit_tree_rejects_unknown_blob(repo: Repository) -> None:
    with pytest.raises(ObjectMissing):
        repo.commit_tree({"f": Blob("ab" * 32, 3)}, thread="t")
    assert repo.threads() == {}


def test_resolve_rules(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    commits = []
    for i in range(40):  # enough commits that some share a first hex digit
        (src / "f").write_text(str(i))
        commits.append(repo.commit_dir(src, thread="main"))
    c = commits[-1]
    assert repo.resolve(c.id) == c.id
    assert repo.resolve(c.id[:8]) == c.id
    assert repo.resolve(c.id[:20].upper()) == c.id
    assert repo.resolve("main") == c.id
    with pytest.raises(InvalidRef) as short:
        repo.resolve(c.id[:7])
    assert isinstance(short.value, BadRequest) and short.value.reason == "invalid_ref"
    with pytest.raises(UnknownRef) as unknown:
        repo.resolve("no-such-thread")
    assert isinstance(unknown.value, NotFound) and unknown.value.reason == "unknown_ref"
    with pytest.raises(UnknownRef):
        repo.resolve("0" * 64)
    with pytest.raises(InvalidRef):
        repo.resolve("")
    # an ambiguous 8-digit prefix: insert two fake index rows sharing one
    ids = sorted(x.id for x in commits)
    fake = [ids[0][:8] + "0" * 56, ids[0][:8] + "f" * 56]
    repo.index._db.executemany(
        "INSERT INTO commits VALUES (?, 0, 't', 'x', x'00')", [(f,) for f in fake])
    with pytest.raises(AmbiguousRef) as amb:
        repo.resolve(ids[0][:8])
    assert isinstance(amb.value, BadRequest) and amb.value.reason == "ambiguous_ref"


def test_cas_on_threads(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("1")
    a = repo.commit_dir(src, thread="main", expected_tip=None)
    with pytest.raises(RefConflict) as err:
        repo.commit_dir(src, thread="main", expected_tip=None)
    assert isinstance(err.value, Conflict) and err.value.reason == "ref_conflict"
    b = repo.commit_dir(src, thread="main", expected_tip=a.id)
    with pytest.raises(RefConflict):
        repo.commit_dir(src, thread="main", expected_tip=a.id)
    assert repo.threads() == {"main": b.id}
    repo.set_thread("branch", a.id, expected=None)
    with pytest.raises(RefConflict):
        repo.set_thread("branch", b.id, expected=b.id)
    repo.set_thread("branch", b.id[:10], expected=a.id)
    assert repo.threads() == {"main": b.id, "branch": b.id}
    with pytest.raises(RefConflict):
        repo.delete_thread("branch", expected=a.id)
    repo.delete_thread("branch")
    with pytest.raises(UnknownRef):
        repo.delete_thread("branch")
    with pytest.raises(InvalidRef):
        repo.set_thread("bad\nname", a.id)
    with pytest.raises(UnknownRef):
        repo.set_thread("x", "f" * 64)


def test_threads_and_log_form_a_dag(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()

    def snap(text: str, thread: str, parents: list[str] | None = None) -> Commit:
        (src / "f").write_text(text)
        return repo.commit_dir(src, thread=thread, message=text, parents=parents)

    root = snap("root", "main")
    m1 = snap("m1", "main")
    b1 = snap("b1", "exp", parents=[root.id])
    b2 = snap("b2", "exp")
    merge = snap("merge", "main", parents=[m1.id, b2.id])
    assert b2.parents == (b1.id,)
    assert merge.parents == (m1.id, b2.id)
    assert [c.id for c in repo.log("exp")] == [b2.id, b1.id, root.id]
    assert [c.id for c in repo.log("main")] == [merge.id, b2.id, b1.id, m1.id, root.id]
    assert [c.id for c in repo.log()] == [merge.id, b2.id, b1.id, m1.id, root.id]
    assert repo.threads() == {"main": merge.id, "exp": b2.id}
    assert repo.get_commit("exp") == b2
    assert repo.get_commit(b2.id[:12]).message == "b2"
    repo.delete_thread("exp")
    assert len(repo.log()) == 5  # commits stay until gc
    report = gc(repo)
    assert report.commits_removed == []  # all still reachable through the merge
    with pytest.raises(UnknownRef):
        repo.log("exp")


def test_find_commits_by_metadata(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    a = repo.commit_dir(src, thread="a", metadata={"notebook_path": "nb/one.ipynb",
                                                   "kernel_id": "k1", "execution_count": 3,
                                                   "gpu": {"name": "H100", "count": 1}})
    b = repo.commit_dir(src, thread="b", metadata={"notebook_path": "nb/one.ipynb",
                                                   "kernel_id": "k2", "execution_count": 3})
    c = repo.commit_dir(src, thread="a", metadata={"notebook_path": "nb/two.ipynb"})
    assert [x.id for x in repo.find_commits(notebook_path="nb/one.ipynb")] == [b.id, a.id]
    assert [x.id for x in repo.find_commits(notebook_path="nb/one.ipynb", kernel_id="k1")] \
        == [a.id]
    assert [x.id for x in repo.find_commits(execution_count=3, thread="b")] == [b.id]
    assert [x.id for x in repo.find_commits(gpu={"count": 1, "name": "H100"})] == [a.id]
    assert repo.find_commits(notebook_path="nope") == []
    assert [x.id for x in repo.find_commits(thread="a")] == [c.id, a.id]
    # the index is derived data: after a rebuild the same answers come back
    rebuild_index(repo)
    assert [x.id for x in repo.find_commits(notebook_path="nb/one.ipynb")] == [b.id, a.id]


def test_store_files_are_private(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("secret")
    os.chmod(src / "f", 0o644)
    repo.commit_dir(src, thread="main")
    for p in [repo.path, *repo.path.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o077 == 0, f"{p} has mode {oct(mode)}"


def test_open_init_errors_and_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    with pytest.raises(StoreNotFound) as nf:
        Repository.open(tmp_path / "nothing")
    assert isinstance(nf.value, NotFound)
    r = Repository.open_or_init(tmp_path / "s")
    assert Repository.open_or_init(tmp_path / "s").config.id == r.config.id
    with pytest.raises(StoreExists):
        Repository.init(tmp_path / "s")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(StoreExists):
        Repository.init(tmp_path / "busy")
    cfg = (tmp_path / "s" / "config")
    cfg.write_text(cfg.read_text().replace('"version": 2', '"version": 99'))
    with pytest.raises(UnsupportedFormat):
        Repository.open(tmp_path / "s")
    monkeypatch.setenv("INFINIJUP_STORE", str(tmp_path / "env-store"))
    assert default_store_path() == tmp_path / "env-store"
    monkeypatch.delenv("INFINIJUP_STORE")
    assert default_store_path() == Path.home() / ".local/share/infinijup/store"


def test_stats_and_gc_of_deleted_thread(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep.img").write_bytes(random_bytes(500_000, seed=10))
    keep = repo.commit_dir(src, thread="keep")
    (src / "tmp.img").write_bytes(random_bytes(3_000_000, seed=11))
    repo.commit_dir(src, thread="scratch")
    before = repo.stats()
    assert before["commits"] == 2 and before["threads"] == 2
    dry = gc(repo, dry_run=True)
    assert dry.dry_run and dry.commits_removed == [] and dry.bytes_freed == 0
    repo.delete_thread("scratch")
    dry = gc(repo, dry_run=True)
    assert len(dry.commits_removed) == 1
    assert repo.stats() == {**before, "threads": 1}  # a dry run changes nothing
    report = gc(repo)
    assert len(report.commits_removed) == 1 and report.bytes_freed > 2_900_000
    after = repo.stats()
    assert after["commits"] == 1 and after["pack_bytes"] < before["pack_bytes"] - 2_900_000
    assert check(repo, read_data=True).ok
    out = tmp_path / "out"
    checkout_dir(repo, keep.id, out)
    assert (out / "keep.img").read_bytes() == (src / "keep.img").read_bytes()


def test_gc_shrinks_the_index_journal_of_an_open_store(tmp_path):
    """A server keeps its store open for days: gc must leave no big WAL behind."""
    import numpy as np

    from infinijup.store import Repository

    repo = Repository.open_or_init(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for _ in range(30):
        (src / "pages-1.img").write_bytes(rng.bytes(1 << 20))
        repo.commit_dir(src, thread="main")
    repo.delete_thread("main")
    gc(repo)
    wal = tmp_path / "store" / "index.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size < 1 << 20, wal.stat().st_size
    repo.close()
