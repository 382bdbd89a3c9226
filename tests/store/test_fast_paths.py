"""The fast paths of ingest and checkout keep the store's guarantees.

Ingest: chunk ids are BLAKE3 of the content (also for all-zero chunks, which are not hashed
again), compression is skipped only where it would not pay, the pack header built from
columns is the one ``encode_header`` gives, and the bulk index statements answer like the
per-row ones. Checkout: coalesced runs still verify every chunk, so damage anywhere in a run
(raw or zstd chunk, or a truncated pack) is a ``ChecksumMismatch`` naming the object.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import zstandard
from conftest import CHUNKERS, page_image, random_bytes

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.chunking import chunk_lengths
from infinijup.store.errors import ChecksumMismatch, ObjectMissing, StoreError
from infinijup.store.layout import pack_files
from infinijup.store.objects import Commit, hash_bytes
from infinijup.store.packs import DELTA, RAW, ZSTD, PackWriter, encode_header, read_pack_header
from infinijup.store.writer import PROBE_MIN


def expected_ids(repo: Repository, data: bytes) -> list[bytes]:
    """Chunk ids computed the slow, obvious way: cut sequentially, hash every chunk."""
    out, pos = [], 0
    for n in chunk_lengths(repo.chunker, data):
        out.append(hash_bytes(data[pos : pos + n]))
        pos += n
    return out


def blob_chunks(repo: Repository, data: bytes, threads: int | None = None) -> list[bytes]:
    with repo.writer(threads=threads) as w:
        blob = w.add_stream(io.BytesIO(data))
        w.flush()
    size, ids = repo.get_blob_chunks(blob.id)
    assert size == len(data)
    assert repo.read_blob(blob.id) == data
    return ids


def structured(n: int, seed: int) -> bytes:
    """Compressible bytes (small integers)."""
    return np.random.default_rng(seed).integers(0, 8, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("name", sorted(CHUNKERS))
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_chunk_ids_are_blake3_of_content_with_zero_pages(tmp_path: Path, name: str,
                                                         threads: int) -> None:
    repo = Repository.init(tmp_path / "store", chunker=CHUNKERS[name], pack_size=1 << 20)
    zeros = bytes(3 << 20)
    data = (random_bytes(1 << 20, seed=1) + zeros + structured(700_001, 2) + bytes(40_000)
            + bytes(page_image(64, seed=3)) + bytes(5000))
    ids = blob_chunks(repo, data, threads)
    assert ids == expected_ids(repo, data)
    # zero chunks are recognised as such: stored once per length, checked out as holes
    out = tmp_path / "out"
    with repo.writer() as w:
        c = w.commit({"img": w.add_stream(io.BytesIO(data))}, thread="t")
    checkout_dir(repo, c.id, out)
    assert (out / "img").read_bytes() == data
    assert os.stat(out / "img").st_blocks * 512 < len(data) - (2 << 20)


def test_zero_detection_is_exact(tmp_path: Path) -> None:
    """A page that is zero but for its last byte, or whose first word is zero, is data."""
    repo = Repository.init(tmp_path / "store")
    pages = np.zeros((64, 4096), dtype=np.uint8)
    pages[5, 4095] = 1
    pages[9, 2048] = 7
    pages[40:, 100] = 3
    data = pages.tobytes()
    assert blob_chunks(repo, data) == expected_ids(repo, data)


def test_incompressible_chunks_are_stored_raw_and_compressible_ones_zstd(
        repo: Repository) -> None:
    # jobs that start incompressible (probing) and jobs that start compressible (no probing)
    rnd, txt = random_bytes(2 << 20, seed=4), structured(2 << 20, 5)
    data = rnd + txt + rnd[::-1] + txt[::-1] + random_bytes(1 << 20, seed=6)
    ids = blob_chunks(repo, data)
    comp: dict[bytes, int] = {}
    for path in pack_files(repo).values():
        for e in read_pack_header(path)[1]:
            comp[e.id] = e.compression
    lengths = chunk_lengths(repo.chunker, data)
    pos = 0
    for cid, n in zip(ids, lengths, strict=True):
        chunk = data[pos : pos + n]
        pos += n
        if len(zstandard.ZstdCompressor(level=1).compress(chunk)) <= n * 0.95:
            assert comp[cid] == ZSTD, "a chunk that compresses well must be stored zstd"
        elif n >= PROBE_MIN:
            assert comp[cid] == RAW
    assert set(comp.values()) == {RAW, ZSTD}


def test_pack_header_from_columns_matches_encode_header(tmp_path: Path) -> None:
    w = PackWriter(tmp_path, tmp_path)
    objs = [random_bytes(n, seed=n) for n in (1, 100, 5000, 0, 77)]
    for i, o in enumerate(objs):
        w.add(1 + i % 3, hash_bytes(o), o, RAW, len(o))
    _name, path, _size = w.finish()
    header, entries = read_pack_header(path)
    assert header == encode_header(w.entries) == encode_header(entries)
    assert [e.offset for e in entries] == [0, 1, 101, 5101, 5101]


def test_bulk_index_queries_match_per_row_queries(repo: Repository) -> None:
    data = random_bytes(3 << 20, seed=7) + structured(1 << 20, 8)
    ids = blob_chunks(repo, data)
    index = repo.index
    probe = ids[::2] + [hash_bytes(b"not stored %d" % i) for i in range(5)] + ids[:3]
    assert index._bulk
    bulk = (index.known(probe), index.lookup_many(probe))
    index._bulk = False
    try:
        slow = (index.known(probe), index.lookup_many(probe))
    finally:
        index._bulk = True
    assert bulk == slow
    assert bulk[0] == set(ids[::2]) | set(ids[:3])
    assert index.known([b"short id"]) == set()  # not 32 bytes: the per-row path answers


def damaged_store(tmp_path: Path, data: bytes, pack_size: int = 128 << 20
                  ) -> tuple[Repository, str, list[bytes]]:
    repo = Repository.init(tmp_path / "store", pack_size=pack_size)  # big packs: long runs
    src = tmp_path / "src"
    src.mkdir()
    (src / "img").write_bytes(data)
    c = repo.commit_dir(src, thread="t")
    entry = repo.get_tree(c.tree)[0]
    return repo, c.id, repo.get_blob_chunks(entry.id)[1]


def flip(repo: Repository, cid: bytes, where: float = 0.5) -> str:
    loc = repo.index.lookup(cid)
    assert loc is not None
    with open(pack_files(repo)[loc.pack], "r+b") as f:
        f.seek(loc.offset + int(loc.length * where))
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    return loc.pack


@pytest.mark.parametrize("kind", [RAW, ZSTD])
def test_damage_inside_a_run_is_named(tmp_path: Path, kind: int) -> None:
    data = b"".join(random_bytes(300_000, seed=s) + structured(300_000, s) for s in range(6))
    repo, commit, chunks = damaged_store(tmp_path, data)
    locs = repo.index.lookup_many(chunks)
    middle = [c for c in chunks[5:-5] if locs[c].compression == kind]
    victim = middle[len(middle) // 2]
    pack = flip(repo, victim)
    with pytest.raises(ChecksumMismatch) as err:
        checkout_dir(repo, commit, tmp_path / "out")
    assert victim.hex() in str(err.value) and pack in str(err.value)
    assert not (tmp_path / "out").exists()
    report = check(repo, read_data=True)
    assert any(victim.hex() in p for p in report.problems)


def test_truncated_pack_inside_a_run_is_a_short_read(tmp_path: Path) -> None:
    data = random_bytes(6 << 20, seed=9)
    repo, commit, chunks = damaged_store(tmp_path, data, pack_size=2 << 20)
    victim = chunks[len(chunks) // 2]  # in a middle pack: not the one with tree and blob
    loc = repo.index.lookup(victim)
    assert loc is not None
    os.truncate(pack_files(repo)[loc.pack], loc.offset + loc.length // 2)
    with pytest.raises(ChecksumMismatch, match="short read") as err:
        checkout_dir(repo, commit, tmp_path / "out")
    assert victim.hex() in str(err.value)


@pytest.mark.parametrize("threads", [1, 4])
def test_checkout_of_many_runs_and_duplicates(tmp_path: Path, threads: int) -> None:
    """Chunks repeated inside a file, runs split by zero chunks, several packs."""
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20)
    part = random_bytes(500_000, seed=10) + structured(500_000, 11)
    data = part + bytes(1 << 20) + part + random_bytes(3 << 20, seed=12) + part
    src = tmp_path / "src"
    src.mkdir()
    (src / "img").write_bytes(data)
    c = repo.commit_dir(src, thread="t", threads=threads)
    checkout_dir(repo, c.id, tmp_path / "out", threads=threads)
    assert (tmp_path / "out" / "img").read_bytes() == data


def one_file_store(tmp_path: Path, data: bytes, threads: int | None = None
                   ) -> tuple[Repository, Commit]:
    """A store of 1 MiB packs holding one commit of one file, ``img``."""
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20)
    src = tmp_path / "src"
    src.mkdir()
    (src / "img").write_bytes(data)
    return repo, repo.commit_dir(src, thread="t", threads=threads)


@pytest.mark.parametrize("threads", [1, 4])
def test_checkout_looks_chunks_up_a_slice_at_a_time(tmp_path: Path, threads: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs are planned while the index still answers for the file's later chunks: a run
    that spans two slices is whole, and a chunk missing from a late slice, found after the
    first runs are written, still fails the checkout and leaves nothing at the target."""
    monkeypatch.setattr("infinijup.store.checkout.LOOKUP_SLICE", 3)
    part = random_bytes(400_000, seed=20) + structured(400_000, 21)
    data = part + bytes(1 << 20) + random_bytes(2 << 20, seed=22) + part
    repo, c = one_file_store(tmp_path, data, threads)
    checkout_dir(repo, c.id, tmp_path / "out", threads=threads)
    assert (tmp_path / "out" / "img").read_bytes() == data
    _, chunks = repo.get_blob_chunks(repo.get_tree(c.tree)[0].id)
    assert len(chunks) > 3 * 3  # several slices
    victim = chunks[-2]
    repo.index._db.execute("DELETE FROM objects WHERE id = ?", (victim,))
    with pytest.raises(ObjectMissing, match=victim.hex()):
        checkout_dir(repo, c.id, tmp_path / "out2", threads=threads)
    assert not (tmp_path / "out2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out2")] == []


def test_large_files_are_written_by_worker_processes(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PROCESS_MIN a plain store's file is read, verified and written by worker
    processes: the bytes come out whole (runs, zero holes, repeated chunks, page deltas),
    and a flipped byte or a missing pack read in a worker fails the checkout, named."""
    import infinijup.store.checkout as checkout

    monkeypatch.setattr(checkout, "PROCESS_MIN", 1 << 20)
    pools: list[int] = []
    real_workers = checkout.Workers
    monkeypatch.setattr(checkout, "Workers", lambda n: pools.append(n) or real_workers(n))
    part = random_bytes(500_000, seed=30) + structured(500_000, 31)
    data = part + bytes(1 << 20) + random_bytes(3 << 20, seed=32) + part
    repo, first = one_file_store(tmp_path, data)
    src = tmp_path / "src"
    changed = bytearray(data)
    changed[4096 * 300 : 4096 * 300 + 8] = b"changed!"  # stored as a page delta
    (src / "img").write_bytes(changed)
    second = repo.commit_dir(src, thread="t")
    assert any(loc.compression == DELTA for loc in repo.index.lookup_many(
        repo.get_blob_chunks(repo.get_tree(second.tree)[0].id)[1]).values())
    for commit, want in ((first, data), (second, bytes(changed))):
        out = tmp_path / f"out-{commit.id[:8]}"
        checkout_dir(repo, commit.id, out, threads=2)
        assert (out / "img").read_bytes() == want
    assert pools == [2, 2]  # one pool of two workers per checkout of the file

    chunks = repo.get_blob_chunks(repo.get_tree(first.tree)[0].id)[1]
    locs = repo.index.lookup_many(chunks)
    victim = next(c for c in chunks[len(chunks) // 2 :]
                  if locs[c].compression == ZSTD and locs[c].length > 1000)
    pack = flip(repo, victim)
    with pytest.raises(ChecksumMismatch) as err:
        checkout_dir(repo, first.id, tmp_path / "bad", threads=2)
    assert victim.hex() in str(err.value) and pack in str(err.value)
    assert not (tmp_path / "bad").exists()
    os.unlink(pack_files(repo)[pack])
    with pytest.raises(ObjectMissing, match=pack):
        checkout_dir(repo, first.id, tmp_path / "gone", threads=2)


def test_a_dead_checkout_worker_fails_the_checkout(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers killed before their first job: the checkout fails with the reason, leaves
    nothing at the target, and a checkout after it works."""
    import infinijup.store.checkout as checkout
    from infinijup.store.checkout_workers import Workers

    monkeypatch.setattr(checkout, "PROCESS_MIN", 1 << 20)
    data = random_bytes(3 << 20, seed=40)
    repo, commit = one_file_store(tmp_path, data)

    def killed(n: int) -> Workers:
        workers = Workers(n)
        for proc in workers._procs:
            proc.kill()
            proc.wait()
        return workers

    monkeypatch.setattr(checkout, "Workers", killed)
    with pytest.raises(StoreError) as err:
        checkout_dir(repo, commit.id, tmp_path / "out", threads=2)
    assert err.value.reason == "checkout_process_died"
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(checkout, "Workers", Workers)
    checkout_dir(repo, commit.id, tmp_path / "out", threads=2)
    assert (tmp_path / "out" / "img").read_bytes() == data


def test_sealed_packs_are_indexed_in_batches(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("infinijup.store.writer.INDEX_BATCH", 20)
    repo = Repository.init(tmp_path / "store", pack_size=256 << 10)
    data = random_bytes(3 << 20, seed=13)
    with repo.writer(threads=8) as w:  # several io threads write one pack concurrently
        blob = w.add_stream(io.BytesIO(data))
        c = w.commit({"img": blob}, thread="t")
    assert len(repo.index.packs()) == len(pack_files(repo)) > 5
    report = check(repo, read_data=True)
    assert report.ok and not report.warnings, (report.problems, report.warnings)
    checkout_dir(repo, c.id, tmp_path / "out")
    assert (tmp_path / "out" / "img").read_bytes() == data
