"""The page files' ranges served from the store for a restore (engine/store_pages.py): every
range a page daemon or a fault may ask, in plain and encrypted stores, across chunk and pack
boundaries, in raw, compressed and delta chunks, is the file's bytes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import page_image, random_bytes
from test_deltas import dirty

from infinijup.engine.store_pages import PARALLEL, StorePages, is_page_file
from infinijup.store import Repository
from infinijup.store.keys import Credentials, KdfParams
from infinijup.store.packs import DELTA

PAGE = 4096
FAST = KdfParams(time_cost=1, memory_kib=1024, parallelism=1)  # tests only


def _store(tmp_path: Path, encrypted: bool) -> tuple[Repository, dict[str, str], bytes]:
    """A store holding two snapshots of one page file, the second a few pages changed (so
    its chunks include deltas against the first); its page files' ids and bytes."""
    creds = None
    if encrypted:
        (tmp_path / "pw").write_text("a password\n")
        (tmp_path / "pw").chmod(0o600)
        creds = Credentials.build(password_file=tmp_path / "pw")
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20, encrypt=creds, kdf=FAST,
                           page_deltas=True)
    image = tmp_path / "img"
    image.mkdir()
    data = page_image(2048, seed=3) + bytearray(random_bytes(2 << 20, 4))
    (image / "pages-1.img").write_bytes(data)
    (image / "pagemap-1.img").write_bytes(b"not pages")
    repo.commit_dir(image, thread="t", message="first")
    dirty(data, 0.01, seed=7)
    (image / "pages-1.img").write_bytes(data)
    commit = repo.commit_dir(image, thread="t", message="second")
    pages = {e.name: e.id for e in repo.get_tree(commit.tree)
             if e.kind == "file" and is_page_file(e.name)}
    return repo, pages, bytes(data)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_every_range_is_the_files_bytes(tmp_path: Path, encrypted: bool) -> None:
    repo, pages, data = _store(tmp_path, encrypted)
    assert list(pages) == ["pages-1.img"]
    served = StorePages(repo, pages)
    try:
        blob = served.files["pages-1.img"]
        assert blob.size == len(data)
        kinds = {blob.locs[c].compression for c in blob.chunks}
        assert DELTA in kinds and len(kinds) >= 2, kinds  # deltas and raw or compressed
        assert len({blob.locs[c].pack for c in blob.chunks}) > 1  # over several packs
        rng = random.Random(11)
        asks = [(0, PAGE), (len(data) - PAGE, PAGE), (0, len(data)), (PAGE, PARALLEL * 2)]
        asks += [(blob.starts[i] - PAGE, 2 * PAGE) for i in range(1, len(blob.starts), 7)]
        for _ in range(40):  # page-aligned, from one page to past PARALLEL
            first = rng.randrange(len(data) // PAGE)
            count = rng.randint(1, min(len(data) // PAGE - first, 2 * PARALLEL // PAGE))
            asks.append((first * PAGE, count * PAGE))
        for offset, length in asks:
            got = served.read("pages-1.img", offset, length)
            assert bytes(got) == data[offset:offset + length], (offset, length)
        with pytest.raises(ValueError, match="past its"):
            served.read("pages-1.img", len(data) - PAGE, 2 * PAGE)
    finally:
        served.close()
        repo.close()
