"""A snapshot's extra file (a GPU kernel's segments) stored from the ranges the kernel says
changed since its last snapshot (engine/extra_files.py, store/incremental.py): real helper,
CRIU and store, a real kernel, a sparse file standing in for the arena's segments."""

import os

from infinijup.engine.engine import SnapshotEngine
from infinijup.engine.extra_files import FileChanges, StoredVersions
from infinijup.store import Repository
from infinijup.store.remote_only import mark_remote_only

MiB = 1 << 20
T1, T2, T3, T4 = "1" * 32, "2" * 32, "3" * 32, "4" * 32


def _stored(repo, result) -> bytes:
    entry = next(e for e in repo.get_tree(result.commit.tree) if e.name == "gpu-segments")
    return repo.read_blob(entry.id)


def test_the_next_snapshot_reads_only_what_changed(client, kernel, tmp_path):
    seg = tmp_path / "segments"
    with open(seg, "wb") as f:
        f.truncate(64 * MiB)
        f.seek(2 * MiB)
        f.write(os.urandom(40 * MiB))
    repo = Repository.init(tmp_path / "store")
    try:
        versions = StoredVersions()  # the server's: it makes an engine for each operation

        def snapshot(changes: FileChanges, parents: list[str]):  # noqa: ANN202
            engine = SnapshotEngine(repo, client, stored_versions=versions)
            return engine.snapshot(kernel.pid, thread="t", message="m", metadata={},
                                   parents=parents, expected_tip=parents[0] if parents else None,
                                   extra_files={"gpu-segments": str(seg)}, file_changes=changes)

        kernel.execute("x = 41")
        first = snapshot(FileChanges(T1), [])
        assert _stored(repo, first) == seg.read_bytes()
        assert first.read_bytes >= 64 * MiB  # all of it, the first time

        with open(seg, "r+b") as f:  # the kernel's next snapshot rewrote 3 MiB of it
            f.seek(10 * MiB + 4096)
            f.write(os.urandom(3 * MiB))
        kernel.execute("x = 42")
        second = snapshot(FileChanges(T2, T1, ((10 * MiB, 4 * MiB),)), [first.commit.id])
        assert _stored(repo, second) == seg.read_bytes()
        # the images are read whole both times; of the file, the changes and a margin
        assert first.read_bytes - second.read_bytes > 50 * MiB, (first, second)

        with open(seg, "r+b") as f:
            f.seek(30 * MiB)
            f.write(os.urandom(MiB))
        unknown = snapshot(FileChanges(T3, "9" * 32, ((30 * MiB, MiB),)), [second.commit.id])
        assert _stored(repo, unknown) == seg.read_bytes()
        assert unknown.read_bytes >= 64 * MiB  # a snapshot this engine did not store: whole

        # that snapshot's chunks left for a remote (the record says so): read whole again
        mark_remote_only(repo, {unknown.commit.id: "s3://bucket/store"})
        with open(seg, "r+b") as f:
            f.seek(50 * MiB)
            f.write(os.urandom(MiB))
        evicted = snapshot(FileChanges(T4, T3, ((50 * MiB, MiB),)), [unknown.commit.id])
        assert _stored(repo, evicted) == seg.read_bytes()
        assert evicted.read_bytes >= 64 * MiB
        assert kernel.evaluate(x="x")["x"] == "42"
    finally:
        repo.close()
