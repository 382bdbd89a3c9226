"""A file stored again from the ranges that changed (store/incremental.py): the blob is the
one a whole ingest gives, with every chunker, wherever the changes fall (start, end, inside
runs of zeros, close together), when the file grows or shrinks, with and without the stored
version's layout; and it reads far less than the file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import page_image, random_bytes

from infinijup.store import Repository, incremental, layouts
from infinijup.store.objects import Blob

KIB = 1024
MIB = 1024 * KIB


def _file(seed: int = 0) -> bytearray:
    """6 MiB like a segments file: random runs, structured pages, a long run of zeros."""
    data = bytearray()
    data += random_bytes(2 * MIB, seed)
    data += page_image(256, seed + 1)  # 1 MiB
    data += bytes(2 * MIB)
    data += random_bytes(MIB, seed + 2)
    return data


def _store(repo: Repository, path: Path, data: bytes | bytearray) -> Blob:
    path.write_bytes(data)
    with repo.writer() as w:
        return w.add_file(path)


def _again(repo: Repository, path: Path, data: bytes | bytearray, base: Blob,
           changed: list[tuple[int, int]]) -> tuple[Blob, Blob, int]:
    """(blob from the changes, blob from the whole file, bytes read for the first)."""
    path.write_bytes(data)
    read = [0]
    real = incremental._Slice.readinto

    def counted(self, view):  # noqa: ANN001, ANN202
        n = real(self, view)
        read[0] += n
        return n

    incremental._Slice.readinto = counted
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            with repo.writer() as w:
                fast = incremental.add_changed_file(w, fd, base=base, changed=changed)
        finally:
            os.close(fd)
    finally:
        incremental._Slice.readinto = real
    with repo.writer() as w:
        whole = w.add_file(path, base=base)
    return fast, whole, read[0]


def _write(data: bytearray, at: int, n: int, seed: int) -> tuple[int, int]:
    data[at:at + n] = random_bytes(n, seed)
    return (at, n)


SCENARIOS = {  # name: (the change, whether a whole ingest cuts the same chunks)
    "middle": (lambda d: [_write(d, MIB + 5000, 70 * KIB, 11)], True),
    "start and end": (lambda d: [_write(d, 0, 4096, 12), _write(d, len(d) - 9000, 9000, 13)],
                      True),
    "close together": (lambda d: [_write(d, MIB, 8192, 14), _write(d, MIB + 40 * KIB, 100, 15),
                                  _write(d, MIB + 300 * KIB, 50 * KIB, 16)], True),
    "said but unchanged": (lambda d: [(2 * MIB, 512 * KIB)], True),
    "one byte": (lambda d: [_write(d, 777_777, 1, 18)], True),
    # a change followed by 2 MiB of zeros: the windows end at a stored cut, not where the
    # zeros end (the chunks after the change are cut from a new place in the run)
    "in the zeros": (lambda d: [_write(d, 3 * MIB + 123, 1000, 17)], False),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_stored_from_the_changes(any_repo: Repository, tmp_path: Path, scenario: str) -> None:
    data = _file()
    path = tmp_path / "segments"
    base = _store(any_repo, path, data)
    change, same_chunks = SCENARIOS[scenario]
    fast, whole, read = _again(any_repo, path, data, base, change(data))
    assert any_repo.read_blob(fast.id) == bytes(data)
    if same_chunks:
        assert fast == whole
    assert read < MIB, f"read {read} of {len(data)} bytes"


@pytest.mark.parametrize("delta", [300 * KIB + 17, -(200 * KIB + 5), -len(_file()) + 4096])
def test_a_file_that_grew_or_shrank(any_repo: Repository, tmp_path: Path, delta: int) -> None:
    data = _file()
    path = tmp_path / "segments"
    base = _store(any_repo, path, data)
    if delta > 0:
        data += random_bytes(delta, 21)
    else:
        del data[len(data) + delta:]
    changed = [_write(data, 1000, 3000, 22)]
    fast, whole, _ = _again(any_repo, path, data, base, changed)
    assert fast == whole
    assert any_repo.read_blob(fast.id) == bytes(data)


def test_with_the_stored_version_s_layout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(layouts, "MIN_CHUNKS", 16)
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20)
    try:
        data = _file(5)
        path = tmp_path / "segments"
        base = _store(repo, path, data)
        assert repo.index.layout(bytes.fromhex(base.id)) is not None
        changed = [_write(data, 2 * MIB + 3 * 4096, 4096, 31)]
        fast, whole, read = _again(repo, path, data, base, changed)
        assert fast == whole
        assert read <= 3 * MIB  # the change and up to the margin past it
    finally:
        repo.close()


def test_a_window_that_does_not_meet_the_stored_cuts(any_repo: Repository, tmp_path: Path,
                                                     monkeypatch) -> None:
    """A window too short to meet the stored version's cuts ends at one of them: the bytes
    are the file's, and the next version stored from that blob is right too."""
    monkeypatch.setattr(incremental, "MARGIN", 0)
    data = _file(7)
    path = tmp_path / "segments"
    base = _store(any_repo, path, data)
    changed = [_write(data, 5 * MIB + 10, 5000, 41), _write(data, 100 * KIB, 64 * KIB, 42)]
    fast, _, read = _again(any_repo, path, data, base, changed)
    assert any_repo.read_blob(fast.id) == bytes(data)
    assert read < 512 * KIB
    changed = [_write(data, 5 * MIB + 1000, 200, 43), _write(data, 90 * KIB, 20 * KIB, 44)]
    again, _, _ = _again(any_repo, path, data, fast, changed)
    assert any_repo.read_blob(again.id) == bytes(data)


def test_most_of_the_file_changed_is_read_whole(repo: Repository, tmp_path: Path) -> None:
    data = _file(9)
    path = tmp_path / "segments"
    base = _store(repo, path, data)
    changed = [_write(data, 0, 4 * MIB, 51)]
    fast, whole, read = _again(repo, path, data, base, changed)
    assert fast == whole
    assert read == 0  # not through the windows: the whole file, as add_file reads it


def test_random_changes(repo: Repository, tmp_path: Path) -> None:
    rng = np.random.default_rng(61)
    data = _file(61)
    path = tmp_path / "segments"
    base = _store(repo, path, data)
    for round_ in range(12):
        changed = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, 200 * KIB))
            at = int(rng.integers(0, len(data) - n))
            if rng.random() < 0.3:
                data[at:at + n] = bytes(n)
                changed.append((at, n))
            else:
                changed.append(_write(data, at, n, 100 + round_))
        fast, _, _ = _again(repo, path, data, base, changed)
        assert repo.read_blob(fast.id) == bytes(data), f"round {round_}: {changed}"
        base = fast  # the next round changes this version
