"""A restore's GPU segments checked out behind the rest of its images (engine/file_behind.py):
real helper, CRIU and store, a real kernel, a file standing in for the arena's segments.

The images come back without the file; the file follows, byte for byte; a damaged chunk of it
fails the wait with the reason and leaves no partial file; the remote sync's pin of the commit
is held until the file is written."""

import asyncio
import contextlib
import os

import pytest

from infinijup.engine.engine import SnapshotEngine
from infinijup.engine.extra_files import FileChanges
from infinijup.errors import RestoreFailed
from infinijup.store import Repository
from infinijup.store.layout import pack_files

MiB = 1 << 20


@pytest.fixture
def stored(client, kernel, tmp_path):  # noqa: ANN001, ANN201
    """A real kernel's snapshot with a 48 MiB file (24 MiB random, the rest holes) as its GPU
    segments: (repo, engine, commit id, the file)."""
    seg = tmp_path / "segments"
    with open(seg, "wb") as f:
        f.truncate(48 * MiB)
        f.seek(4 * MiB)
        f.write(os.urandom(24 * MiB))
    repo = Repository.init(tmp_path / "store")
    try:
        kernel.execute("x = 7")
        engine = SnapshotEngine(repo, client)
        result = engine.snapshot(kernel.pid, thread="t", message="m", metadata={}, parents=[],
                                 expected_tip=None, extra_files={"gpu-segments": str(seg)},
                                 file_changes=FileChanges("1" * 32))
        yield repo, engine, result.commit.id, seg
    finally:
        repo.close()


def test_the_images_come_first_and_the_segments_follow(stored):
    repo, engine, commit, seg = stored
    info = {"behind": "gpu-segments"}
    images = engine.materialize(commit, info)
    behind = info["file_behind"]
    assert not (images / "gpu-segments").exists()
    assert any(p.name.startswith("pages-") for p in images.iterdir())  # CRIU's, all there
    assert behind.path == images.parent / f"{images.name}.gpu-segments"
    assert asyncio.run(behind.done()) == behind.path
    assert behind.path.read_bytes() == seg.read_bytes()
    assert behind.seconds is not None
    # nothing left behind where none was asked for, or the commit has no such file
    plain = {}
    whole = engine.materialize(commit, plain)
    assert "file_behind" not in plain and (whole / "gpu-segments").is_file()
    other = {"behind": "no-such-file"}
    assert (engine.materialize(commit, other) / "gpu-segments").is_file()
    assert "file_behind" not in other


def test_a_damaged_chunk_of_the_file_behind_fails_its_wait(stored):
    repo, engine, commit, _seg = stored
    entry = next(e for e in repo.get_tree(repo.get_commit(commit).tree)
                 if e.name == "gpu-segments")
    chunks = repo.get_blob_chunks(entry.id)[1]
    locs = repo.index.lookup_many(chunks)
    loc = max(locs.values(), key=lambda loc: loc.length)  # random data, not a hole
    with open(pack_files(repo)[loc.pack], "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    released = []

    @contextlib.contextmanager
    def pin():  # noqa: ANN202 - as the remote sync's
        yield
        released.append(True)

    info = {"behind": "gpu-segments"}
    images = engine.materialize(commit, info)  # the images are whole: it succeeds
    assert any(p.name.startswith("pages-") for p in images.iterdir())
    behind = info["file_behind"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(pin())
        behind.hold(stack.pop_all())
    with pytest.raises(RestoreFailed) as err:
        asyncio.run(behind.done())
    assert err.value.reason == "checksum_mismatch", err.value
    assert "gpu-segments" in err.value.message and "ended" in err.value.message
    assert not behind.path.exists()  # no partial file left
    assert released == [True]  # the pin went with the thread
