"""The page files' ranges served from the store for a restore (engine/store_pages.py): every
range a page daemon or a fault may ask, in plain and encrypted stores, across chunk and pack
boundaries, in raw, compressed and delta chunks, is the file's bytes."""

from __future__ import annotations

import json
import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import page_image, random_bytes
from test_deltas import dirty

from infinijup.engine import store_pages
from infinijup.engine.store_pages import PARALLEL, StorePages, is_page_file
from infinijup.store import Repository, layouts
from infinijup.store.errors import ObjectMissing
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


@pytest.mark.parametrize("encrypted, layout, behind", [
    (False, False, False), (True, False, False), (False, True, False), (False, True, True)],
    ids=["plain", "encrypted", "layout, asks locate", "layout, located behind"])
def test_every_range_is_the_files_bytes(tmp_path: Path, monkeypatch, encrypted: bool,
                                        layout: bool, behind: bool) -> None:
    """Without a layout every chunk is located first; with one (store/layouts.py: the blob
    is recorded as large) the asks locate what they need, with the packs opened behind the
    restore first, or (left out here) not yet."""
    if layout:
        monkeypatch.setattr(layouts, "MIN_CHUNKS", 1)
        if not behind:
            monkeypatch.setattr(StorePages, "_look_up_behind", lambda self: None)
    repo, pages, data = _store(tmp_path, encrypted)
    assert list(pages) == ["pages-1.img"]
    served = StorePages(repo, pages)
    try:
        blob = served.files["pages-1.img"]
        assert blob.size == len(data)
        assert blob.behind == layout
        if layout:
            served._behind.join()
            assert blob.locs == {}  # the asks locate their chunks
            packs = {loc.pack for loc in repo.index.lookup_many(blob.chunks).values()}
            assert set(served.reader._packs._fds) == (packs if behind else set())
        rng = random.Random(11)
        asks = [(0, PAGE), (len(data) - PAGE, PAGE), (0, len(data)), (PAGE, PARALLEL * 2)]
        asks += [(int(blob.starts[i]) - PAGE, 2 * PAGE) for i in range(1, len(blob.starts), 7)]
        for _ in range(40):  # page-aligned, from one page to past PARALLEL
            first = rng.randrange(len(data) // PAGE)
            count = rng.randint(1, min(len(data) // PAGE - first, 2 * PARALLEL // PAGE))
            asks.append((first * PAGE, count * PAGE))
        for offset, length in asks:
            got = served.read("pages-1.img", offset, length)
            assert bytes(got) == data[offset:offset + length], (offset, length)
        with pytest.raises(ValueError, match="past its"):
            served.read("pages-1.img", len(data) - PAGE, 2 * PAGE)
        kinds = {blob.locs[c].compression for c in blob.chunks}  # all located by now
        assert DELTA in kinds and len(kinds) >= 2, kinds  # deltas and raw or compressed
        assert len({blob.locs[c].pack for c in blob.chunks}) > 1  # over several packs
    finally:
        served.close()
        repo.close()


def test_a_layout_that_does_not_fit_its_blob_is_not_used(tmp_path: Path, monkeypatch) -> None:
    """A layout row of other lengths (a damaged index) is passed over: every chunk is
    located first, and the ranges are still the file's bytes."""
    monkeypatch.setattr(layouts, "MIN_CHUNKS", 1)
    repo, pages, data = _store(tmp_path, False)
    blob_id = bytes.fromhex(pages["pages-1.img"])
    good = repo.index.layout(blob_id)
    count = len(repo.get_blob_chunks(pages["pages-1.img"])[1])
    wrong = layouts.encode(np.arange(1, count + 1) * PAGE)  # a page each: not its total
    repo.index._write([("UPDATE layouts SET lengths=? WHERE id=?", (wrong, blob_id), False)])
    assert layouts.starts(good, count, len(data)) is not None
    served = StorePages(repo, pages)
    try:
        assert not served.files["pages-1.img"].behind
        assert bytes(served.read("pages-1.img", 0, len(data))) == data
    finally:
        served.close()
        repo.close()


def test_a_chunk_the_store_lacks_fails_the_asks_for_it_only(tmp_path: Path,
                                                           monkeypatch) -> None:
    """With a layout the serving process is ready before it has located every chunk: a
    chunk missing from the index fails the ask that needs it (the restore then fails as when
    a pack goes mid-stream), and asks elsewhere are answered."""
    monkeypatch.setattr(layouts, "MIN_CHUNKS", 1)
    repo, pages, data = _store(tmp_path, False)
    _size, chunks = repo.get_blob_chunks(pages["pages-1.img"])
    k = next(i for i in range(len(chunks) // 2, len(chunks)) if chunks.count(chunks[i]) == 1)
    gone = chunks[k]  # one chunk, in one place
    repo.index._write([("DELETE FROM objects WHERE id=?", (gone,), False)])
    served = StorePages(repo, pages)  # no ObjectMissing here: located behind
    try:
        blob = served.files["pages-1.img"]
        assert blob.behind
        served._behind.join()  # it found one chunk missing, and said so
        start = int(blob.starts[k])
        with pytest.raises(ObjectMissing, match=gone.hex()):
            served.read("pages-1.img", start - start % PAGE, PAGE)
        assert bytes(served.read("pages-1.img", 0, PAGE)) == data[:PAGE]
        assert bytes(served.read("pages-1.img", start - PAGE, PAGE)) \
            == data[start - PAGE:start]  # the chunk before it
    finally:
        served.close()
        repo.close()


def test_the_serving_process_imports_only_what_it_serves_with(tmp_path: Path) -> None:
    """A restore from the store waits for its serving process to start: the process opens
    the store and serves a page without the engine's or the store's other modules (checkout,
    check, gc, the writer's packing: a third of its start-up on the 2-core VM)."""
    repo, pages, data = _store(tmp_path, False)
    repo.close()
    code = (
        "import json, sys\n"
        "from infinijup.engine.store_pages import StorePages\n"
        "from infinijup.store import Repository\n"
        "spec = json.loads(sys.argv[1])\n"
        "served = StorePages(Repository.open(spec['store']), spec['pages'])\n"
        "sys.stdout.buffer.write(bytes(served.read('pages-1.img', 0, 4096)))\n"
        "served.close()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('infinijup.'))))\n")
    out = subprocess.run([sys.executable, "-c", code,
                          json.dumps({"store": str(tmp_path / "store"), "pages": pages})],
                         capture_output=True, check=True).stdout
    assert out[:PAGE] == data[:PAGE]
    loaded = set(json.loads(out[PAGE:]))
    assert "infinijup.engine.store_pages" in loaded
    assert not loaded & {"infinijup.engine.engine", "infinijup.engine.hot_tier",
                         "infinijup.store.checkout", "infinijup.store.check",
                         "infinijup.store.gc"}, sorted(loaded)


def _ask_page(where: Path, name: str) -> bytes:
    """The first page of ``name`` asked of a serving process, as the helper asks (on the
    first of its two connections; the second, the stream's, asks nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sk, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
        sk.connect(str(where))
        stream.connect(str(where))
        sk.sendall(struct.pack("<I", len(name)) + name.encode() + struct.pack("<QQ", 0, PAGE))
        got = b""
        while len(got) < PAGE and (part := sk.recv(PAGE - len(got))):
            got += part
        return got


def test_a_restore_takes_the_serving_process_started_ahead(tmp_path: Path,
                                                           monkeypatch) -> None:
    """The process started ahead (``start_spare``) serves the next restore, and the end of
    that restore starts the one after; one started in another environment (another store's
    key, a test's fault point) is ended, not used; ``stop_spare`` ends the one waiting."""
    repo, pages, data = _store(tmp_path, False)
    procs = []
    try:
        store_pages.start_spare()
        ahead = store_pages._spare[0]
        served = store_pages.StorePagesProcess(repo, pages, tmp_path / "one.sock")
        procs.append(served.proc)
        assert served.proc is ahead
        served.wait_ready()
        assert _ask_page(tmp_path / "one.sock", "pages-1.img") == data[:PAGE]
        served.stop_listening()
        assert served.proc.wait(timeout=30) == 0
        nxt = store_pages._spare[0]  # started as the restore ended
        assert nxt is not ahead and nxt.poll() is None

        monkeypatch.setenv("INFINIJUP_TEST_OTHER_ENVIRONMENT", "1")
        served = store_pages.StorePagesProcess(repo, pages, tmp_path / "two.sock")
        procs.append(served.proc)
        assert served.proc is not nxt
        assert nxt.wait(timeout=30) is not None  # ended, never told anything
        served.wait_ready()
        assert _ask_page(tmp_path / "two.sock", "pages-1.img") == data[:PAGE]
        served.stop_listening()
        assert served.proc.wait(timeout=30) == 0
        waiting = store_pages._spare[0]
        store_pages.stop_spare()
        assert store_pages._spare is None and waiting.wait(timeout=30) == 0
    finally:
        store_pages.stop_spare()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        repo.close()
