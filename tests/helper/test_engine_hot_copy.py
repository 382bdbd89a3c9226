"""A snapshot's extra files (a GPU kernel's segments) go into the hot tier by a copy made beside
the store's ingest (engine/extra_files.py, HotCopy): real helper, CRIU and store, a real kernel,
a sparse file standing in for the arena's segments."""

import os
import threading

import pytest
from helperkit import wait_for

from infinijup.engine.engine import SnapshotEngine
from infinijup.store import Repository
from infinijup.store.errors import RefConflict
from infinijup.store.faults import HOLDS_ENV

MiB = 1 << 20


def _segments(path) -> bytes:
    """A sparse file like the arena's: data, a hole (dead ranges given back), data."""
    with open(path, "wb") as f:
        f.truncate(48 * MiB)
        f.seek(2 * MiB)
        f.write(os.urandom(3 * MiB))
        f.seek(40 * MiB)
        f.write(b"tail" * 1024)
    return path.read_bytes()


def _leftovers(engine: SnapshotEngine) -> list[str]:
    where = engine.work_dir() / "hotcopy"
    return os.listdir(where) if where.exists() else []


def _copying_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "ijhotcopy"]


def test_the_segments_go_hot_beside_the_ingest(client, kernel, tmp_path, monkeypatch):
    """The store's ingest is held at its start (a hold point): the copy for the hot tier is
    made meanwhile, whole; once the ingest goes on, the snapshot is stored and hot."""
    holds = tmp_path / "holds"
    holds.mkdir()
    (holds / "before_ingest").touch()
    monkeypatch.setenv(HOLDS_ENV, str(holds))
    kernel.execute("x = 41")
    seg = tmp_path / "segments"
    content = _segments(seg)
    repo = Repository.init(tmp_path / "store")
    try:
        engine = SnapshotEngine(repo, client, hot_tier_bytes=1 << 30)
        out: dict = {}

        def snapshot() -> None:
            out["result"] = engine.snapshot(
                kernel.pid, thread="t", message="m", metadata={}, parents=[],
                expected_tip=None, extra_files={"gpu-segments": str(seg)})

        snap = threading.Thread(target=snapshot, daemon=True)
        snap.start()
        try:
            wait_for(lambda: (holds / "before_ingest.reached").exists(),
                     what="the ingest's start")
            wait_for(lambda: not _copying_threads(), what="the copy's end")
            [copy] = _leftovers(engine)  # the copy's directory, whole while the ingest waits
            assert (engine.work_dir() / "hotcopy" / copy / "gpu-segments").read_bytes() \
                == content
        finally:
            (holds / "before_ingest").unlink()  # the ingest goes on, whatever happened
            snap.join(120)
        result = out["result"]
        assert result.hot
        hot = engine.hot_tier().root / result.commit.id / "gpu-segments"
        assert hot.read_bytes() == content
        assert hot.stat().st_blocks * 512 < 8 * MiB  # its hole stayed a hole
        stored = next(e for e in repo.get_tree(result.commit.tree) if e.name == "gpu-segments")
        assert repo.read_blob(stored.id) == content
        assert _leftovers(engine) == [] and _copying_threads() == []
        # a restore of it takes its images, the segments with them, from the hot tier
        info: dict = {}
        images = engine.materialize(result.commit.id, info)  # linked: the helper's dir goes
        assert info["source"] == "hot"                        # with the test's helper
        assert (images / "gpu-segments").read_bytes() == content
    finally:
        repo.close()


def test_a_failed_store_stops_the_copy_and_leaves_nothing(client, kernel, tmp_path):
    """The commit is refused (its thread moved meanwhile, no replan): the copy beside it is
    stopped or finished, and either way nothing of it stays in the work dir or the tier."""
    seg = tmp_path / "segments"
    _segments(seg)
    repo = Repository.init(tmp_path / "store")
    try:
        engine = SnapshotEngine(repo, client, hot_tier_bytes=1 << 30)
        hot_before = sorted(os.listdir(engine.hot_tier().root))
        with pytest.raises(RefConflict):
            engine.snapshot(kernel.pid, thread="t", message="m", metadata={}, parents=[],
                            expected_tip="0" * 64, extra_files={"gpu-segments": str(seg)})
        assert _leftovers(engine) == [] and _copying_threads() == []
        assert sorted(os.listdir(engine.hot_tier().root)) == hot_before
        assert kernel.evaluate(x="1 + 1")["x"] == "2"  # the kernel was left running
    finally:
        repo.close()


def test_no_copy_where_the_tier_would_not_keep_it(client, kernel, tmp_path, monkeypatch):
    """The tier's filesystem could not hold the copy and the next dump: no copy is made (nor
    waited for), the snapshot is stored, and it stays out of the tier."""
    from infinijup.engine import engine as engine_module
    from infinijup.engine import hot_tier

    seg = tmp_path / "segments"
    content = _segments(seg)
    started, copies = [], []
    real = hot_tier.HotTier.room_for

    def spy(self, size, writing=0):  # noqa: ANN001, ANN202
        started.append((size, writing))
        return real(self, size, writing)

    real_copy = engine_module.HotCopy

    def copy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        copies.append(args)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(engine_module, "HotCopy", copy)
    monkeypatch.setattr(hot_tier.HotTier, "room_for", spy)
    monkeypatch.setattr(hot_tier, "_free", lambda path: 4 * MiB)
    repo = Repository.init(tmp_path / "store")
    try:
        engine = SnapshotEngine(repo, client, hot_tier_bytes=1 << 30)
        result = engine.snapshot(kernel.pid, thread="t", message="m", metadata={}, parents=[],
                                 expected_tip=None, extra_files={"gpu-segments": str(seg)})
        assert started and started[0][1] >= 3 * MiB  # asked, with the copy's bytes
        assert copies == []  # and no copy made
        assert not result.hot
        stored = next(e for e in repo.get_tree(result.commit.tree) if e.name == "gpu-segments")
        assert repo.read_blob(stored.id) == content
        assert _leftovers(engine) == [] and _copying_threads() == []
    finally:
        repo.close()
