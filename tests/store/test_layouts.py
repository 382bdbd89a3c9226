"""Blob layouts (store/layouts.py): the writer records a large blob's chunk lengths in the
index; they match the chunks' own; none for small blobs or in an encrypted store; gc and
rebuild-index take them away with what they describe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import page_image, random_bytes

from infinijup.store import Repository, layouts
from infinijup.store.gc import gc
from infinijup.store.keys import Credentials, KdfParams
from infinijup.store.rebuild import rebuild_index

FAST = KdfParams(time_cost=1, memory_kib=1024, parallelism=1)  # tests only


def _commit(repo: Repository, tmp_path: Path, big: bytes, small: bytes) -> dict[str, str]:
    image = tmp_path / "img"
    image.mkdir(exist_ok=True)
    (image / "pages-1.img").write_bytes(big)
    (image / "core-1.img").write_bytes(small)
    commit = repo.commit_dir(image, thread="t", message="m")
    return {e.name: e.id for e in repo.get_tree(commit.tree)}


def _rows(repo: Repository) -> int:
    return repo.index._query("SELECT COUNT(*) FROM layouts")[0][0]


def test_a_large_blob_gets_the_layout_of_its_chunks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(layouts, "MIN_CHUNKS", 16)
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20)  # several packs
    try:
        big = bytes(page_image(1024, seed=1)) + random_bytes(1 << 20, 2)
        ids = _commit(repo, tmp_path, big, b"a small file")
        size, chunks = repo.get_blob_chunks(ids["pages-1.img"])
        assert len(chunks) >= 16
        assert len({loc.pack for loc in repo.index.lookup_many(chunks).values()}) > 1
        known = layouts.starts(repo.index.layout(bytes.fromhex(ids["pages-1.img"])),
                               len(chunks), size)
        assert known is not None
        starts, lengths = known
        locs = repo.index.lookup_many(chunks)
        assert lengths.tolist() == [locs[c].raw_length for c in chunks]
        assert starts[0] == 0 and int(starts[-1] + lengths[-1]) == len(big)
        assert repo.index.layout(bytes.fromhex(ids["core-1.img"])) is None  # one chunk
        assert _rows(repo) == 1
        uniq = list(dict.fromkeys(chunks))  # what opens a restore's packs (store_pages.py)
        packs = {loc.pack for loc in locs.values()}
        assert repo.index.packs_holding(uniq) == (packs, len(uniq))
        assert repo.index.packs_holding(uniq + [b"\x01" * 32]) == (packs, len(uniq))

        # gc takes the layout with its blob; rebuild-index starts without any
        repo.delete_thread("t")
        gc(repo)
        assert _rows(repo) == 0
        _commit(repo, tmp_path, big[::-1], b"another")
        assert _rows(repo) == 1
        rebuild_index(repo)
        assert _rows(repo) == 0
    finally:
        repo.close()


def test_an_encrypted_store_records_no_layout(tmp_path: Path, monkeypatch) -> None:
    """There the order of a blob's chunk lengths is not in the clear."""
    monkeypatch.setattr(layouts, "MIN_CHUNKS", 16)
    (tmp_path / "pw").write_text("a password\n")
    (tmp_path / "pw").chmod(0o600)
    creds = Credentials.build(password_file=tmp_path / "pw")
    repo = Repository.init(tmp_path / "store", encrypt=creds, kdf=FAST)
    try:
        ids = _commit(repo, tmp_path, random_bytes(4 << 20, 3), b"small")
        assert len(repo.get_blob_chunks(ids["pages-1.img"])[1]) >= 16
        assert _rows(repo) == 0
    finally:
        repo.close()


def test_a_layout_is_checked_against_its_blob() -> None:
    data = layouts.encode(np.array([4096, 12288, 20480]))
    starts, lengths = layouts.starts(data, 3, 20480)
    assert starts.tolist() == [0, 4096, 12288] and lengths.tolist() == [4096, 8192, 8192]
    assert layouts.starts(data, 3, 20481) is None  # another total
    assert layouts.starts(data, 4, 20480) is None  # another count
    assert layouts.starts(b"not zstd", 3, 20480) is None
    assert layouts.starts(None, 3, 20480) is None
