"""Where the arena file may differ from the last snapshot's (gpu/file_changes.py), on the CPU:
blocks whose hash is the last snapshot's and holes then and now are left out, everything
else is in; and what a kernel says of it is checked field by field (engine/extra_files.py)."""

from __future__ import annotations

import os

from infinijup.engine.extra_files import FileChanges, StoredVersions
from infinijup.gpu import file_changes
from infinijup.store.objects import Blob

MIB = 1 << 20
TOKEN, OTHER = "a" * 32, "b" * 32


def test_the_holes_of_a_sparse_file(tmp_path):
    path = tmp_path / "segments"
    with open(path, "wb") as f:
        f.truncate(16 * MIB)
        f.seek(2 * MIB)
        f.write(b"x" * MIB)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = file_changes.holes(fd)
    finally:
        os.close(fd)
    assert found[0] == (0, 2 * MIB)
    assert found[-1][1] == 16 * MIB and found[-1][0] >= 3 * MIB  # tmpfs and ext4 alike
    assert len(found) == 2


def test_kept_blocks_are_those_whose_hash_is_the_last_one():
    before = {(0x1000, 2 * MIB, 0): (1, 2), (0x201000, 2 * MIB, 2 * MIB): (3, 4),
              (0x401000, MIB, 4 * MIB): (5, 6)}
    now = {(0x1000, 2 * MIB, 0): (1, 2), (0x201000, 2 * MIB, 2 * MIB): (3, 5),  # changed
           (0x401000, MIB, 4 * MIB): (5, 6), (0x501000, MIB, 5 * MIB): (7, 8)}  # new
    assert sorted(file_changes.kept_blocks(now, before)) == [(0, 2 * MIB),
                                                             (4 * MIB, 5 * MIB)]


def test_changed_is_everything_but_kept_blocks_and_holes_both_times():
    size = 10 * MIB
    kept = [(0, 2 * MIB), (4 * MIB, 5 * MIB)]
    holes_before = [(6 * MIB, 8 * MIB)]
    holes_now = [(7 * MIB, 9 * MIB)]  # 7-8 MiB a hole both times
    assert file_changes.changed(size, kept, holes_before, holes_now) == [
        (2 * MIB, 2 * MIB), (5 * MIB, 2 * MIB), (8 * MIB, 2 * MIB)]


def test_a_file_that_shrank_or_kept_nothing():
    assert file_changes.changed(3 * MIB, [(0, 4 * MIB)], [], []) == []
    assert file_changes.changed(3 * MIB, [], [], []) == [(0, 3 * MIB)]
    assert file_changes.changed(3 * MIB, [(MIB, 2 * MIB)], [(0, MIB)], [(0, MIB // 2)]) == [
        (MIB // 2, MIB // 2), (2 * MIB, MIB)]


def test_what_a_kernel_says_of_its_file_is_checked():
    assert FileChanges.parse({"token": TOKEN}) == FileChanges(TOKEN)
    good = {"token": TOKEN, "file_changes": {"since": OTHER, "changed": [[0, 10], [20, 5]]}}
    assert FileChanges.parse(good) == FileChanges(TOKEN, OTHER, ((0, 10), (20, 5)))
    for bad in ({"since": "x" * 32, "changed": []}, {"since": OTHER, "changed": [[0, -1]]},
                {"since": OTHER, "changed": [[0, 1.5]]}, {"since": OTHER, "changed": [[0]]},
                {"since": OTHER, "changed": "all"}, {"since": OTHER, "changed": [[0, True]]}):
        assert FileChanges.parse({"token": TOKEN, "file_changes": bad}) == FileChanges(TOKEN)
    assert FileChanges.parse({"token": "../x", "file_changes": good["file_changes"]}) is None
    assert FileChanges.parse(None) is None


def test_stored_versions_are_found_by_store_and_token_and_the_oldest_forgotten():
    versions = StoredVersions()
    blob = Blob("c" * 64, 10)
    versions.remember("s1", OTHER, "d" * 64, {"gpu-segments": blob})
    assert versions.base("s1", FileChanges(TOKEN, OTHER, ()), "gpu-segments") == ("d" * 64, blob)
    assert versions.base("s2", FileChanges(TOKEN, OTHER, ()), "gpu-segments") is None
    assert versions.base("s1", FileChanges(TOKEN, OTHER, ()), "other") is None
    assert versions.base("s1", FileChanges(TOKEN), "gpu-segments") is None
    assert versions.base("s1", None, "gpu-segments") is None
    for i in range(StoredVersions.KEEP):
        versions.remember("s1", f"{i:032x}", "e" * 64, {"gpu-segments": blob})
    assert versions.base("s1", FileChanges(TOKEN, OTHER, ()), "gpu-segments") is None
    assert versions.base("s1", FileChanges(TOKEN, f"{1:032x}", ()), "gpu-segments") == (
        "e" * 64, blob)
