"""``checkout_dir(repo, ref, path)``: materializing stored trees on disk, reading and
verifying chunks on all cores.

A file's chunks are planned into *runs*: consecutive chunks of the file that also lie back to
back in one pack (the usual case: ingest appends a stream's new chunks in order). A worker
reads a whole run with one ``preadv`` into a reused buffer, decompresses its zstd chunks a
few at a time (``multi_decompress_to_buffer`` over up to 128 KiB of output: one GIL release
per group), BLAKE3-verifies every chunk, and writes the run with one ``pwritev`` at its
offset in the file. So the
per-chunk work is one hash and the rest is per run: few, large system calls and no copies
of raw chunks. All-zero chunks are not written (they stay holes). A chunk stored as a page
delta is a run of its own: its payload is read the same way, its sources are read through
``ObjectReader`` and the rebuilt chunk is verified as a whole. In an encrypted store each
chunk of a run is opened (AES-256-GCM) after the read, into one buffer of payloads that
is then decoded as a plain run, and ids are keyed; its raw and zstd chunks are not hashed
again: the tag of each (its keyed id, type and compression are the associated data) already
proved that the payload is the one a key holder sealed under that id, and a flipped or moved
byte fails it (docs/store.md, "Verifying an encrypted store's reads", says why that is
enough and what only ``store check --read-data`` still finds). Rebuilt deltas are verified.
"""

from __future__ import annotations

import array
import os
import secrets
import shutil
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import blake3
import zstandard

from . import delta
from .chunking import PAGE
from .errors import CheckoutTargetNotEmpty, ChecksumMismatch, CorruptObject, ObjectMissing
from .index import Location
from .objects import CHUNK, Commit, TreeEntry, hash_bytes
from .packs import DELTA, ZSTD, pack_path, pwritev_all
from .reader import ObjectReader
from .thinned import refuse_thinned
from .writer import default_threads

if TYPE_CHECKING:
    from .repository import Repository

BATCH = 8 << 20  # bytes of file content per read/verify/write job
RUN_MAX = 4 << 20  # stored (and raw) bytes of one run: one preadv, one pwritev
# Plaintext bytes per decompression call: one call per group releases the GIL once for
# several chunks, and its output buffer stays small enough for malloc to recycle (a fresh
# multi-MiB output per run costs page faults, one per 4 KiB: measured per GB checked out,
# ~28K faults at 128 KiB against ~100K at 256 KiB and 150K-270K with one call per run).
DECOMPRESS_GROUP = 128 << 10

#: One run: (pack, offset in the pack, stored bytes, offset in the file, chunks as
#: (id, stored length, raw length, compression)).
Run = tuple[str, int, int, int, list[tuple[bytes, int, int, int]]]


def checkout_dir(repo: Repository, ref: str, path: str | os.PathLike[str], *,
                 threads: int | None = None) -> Commit:
    """Materialize the tree of ``ref`` at ``path`` (absent or an empty directory).

    Files get their recorded modes; runs of zero pages become holes. The tree is built
    in a hidden sibling directory and renamed into place, so ``path`` never holds a
    partial checkout.
    """
    commit = repo.get_commit(ref)
    refuse_thinned(repo, commit.id)
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckoutTargetNotEmpty(f"{target} exists and is not an empty directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.checkout-{secrets.token_hex(4)}"
    os.mkdir(tmp, 0o700)
    try:
        with Materializer(repo, threads=threads) as m:
            m.tree(commit.tree, tmp)
        if target.exists():
            os.rmdir(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit


class Materializer:
    """Writes trees and files of one store; owns a thread pool and open pack handles."""

    def __init__(self, repo: Repository, *, threads: int | None = None) -> None:
        self.repo = repo
        n = max(1, threads or default_threads())
        self.threads = n
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="ijcheckout") if n > 1 else None
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()
        self._local = threading.local()
        self._key = repo.key
        self._zero_ids = _zero_chunk_ids(repo.chunker.max_size, self._key)
        self._reader = ObjectReader(repo)  # delta chunks' sources

    def __enter__(self) -> Materializer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers and close pack files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._reader.close()

    def tree(self, tree_id: str, dest: Path) -> None:
        """Create every entry of tree ``tree_id`` inside the existing directory ``dest``."""
        for entry in self.repo.get_tree(tree_id):
            target = dest / entry.name
            if entry.kind == "file":
                self.file(entry, target)
            elif entry.kind == "dir":
                os.mkdir(target, 0o700)
                self.tree(entry.id, target)
                os.chmod(target, entry.mode)
            else:
                os.symlink(entry.target, target)

    def file(self, entry: TreeEntry, path: Path) -> None:
        """Write the file ``entry`` at ``path`` (which must not exist)."""
        size, chunks = self.repo.get_blob_chunks(entry.id)
        locs = self.repo.index.lookup_many(chunks)
        if len(locs) < len(set(chunks)):
            missing = next(c for c in chunks if c not in locs)
            raise ObjectMissing(f"file {path.name}: chunk {missing.hex()} is not in the store")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        jobs: deque[Future[None]] = deque()
        try:
            offset = self._plan(chunks, locs, fd, jobs)
            while jobs:
                jobs.popleft().result()
            if offset != size:
                raise CorruptObject(f"blob {entry.id}: chunks hold {offset} bytes, not {size}")
            os.ftruncate(fd, size)
        finally:
            for job in jobs:  # on error: let running jobs end before closing their file
                job.exception()
            os.close(fd)
        os.chmod(path, entry.mode)

    def _plan(self, chunks: list[bytes], locs: dict[bytes, Any], fd: int,
              jobs: deque[Future[None]]) -> int:
        """Cut the file into runs, submit them in jobs of ~BATCH bytes; return the size."""
        zero_ids = self._zero_ids
        limit = self.threads * 2
        batch: list[Run] = []
        batch_bytes = 0
        run: list[tuple[bytes, int, int, int]] = []
        run_pack, run_start, run_end, run_file, run_raw = "", 0, -1, 0, 0
        run_delta = False
        offset = 0
        for cid in chunks:
            pack, off, length, raw, _typ, comp = locs[cid]
            if zero_ids.get(raw) == cid:  # zero chunks become holes
                offset += raw
                if run:
                    batch.append((run_pack, run_start, run_end - run_start, run_file, run))
                    run, run_end = [], -1
                continue
            if off != run_end or pack != run_pack or run_end - run_start >= RUN_MAX \
                    or run_raw >= RUN_MAX or comp == DELTA or run_delta:
                if run:
                    batch.append((run_pack, run_start, run_end - run_start, run_file, run))
                    if batch_bytes >= BATCH:
                        jobs.append(self._submit(fd, batch))
                        batch, batch_bytes = [], 0
                        while len(jobs) > limit:
                            jobs.popleft().result()
                run = []
                run_pack, run_start, run_file, run_raw = pack, off, offset, 0
            run.append((cid, length, raw, comp))
            run_end = off + length
            run_delta = comp == DELTA  # a delta is a run of its own
            run_raw += raw
            offset += raw
            batch_bytes += raw
        if run:
            batch.append((run_pack, run_start, run_end - run_start, run_file, run))
        if batch:
            jobs.append(self._submit(fd, batch))
        return offset

    def _submit(self, fd: int, batch: list[Run]) -> Future[None]:
        if self._pool is not None:
            return self._pool.submit(self._write_runs, fd, batch)
        fut: Future[None] = Future()
        try:
            self._write_runs(fd, batch)
            fut.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - raised by result(), as from a pool
            fut.set_exception(exc)
        return fut

    def _write_runs(self, fd: int, runs: list[Run]) -> None:
        """Worker job: read, verify (a plain store's by BLAKE3, an encrypted one's by the
        tags) and write runs (delta chunks last, their sources looked up in one query)."""
        deltas: list[tuple[bytes, Location, bytes, int]] = []
        for pack, start, stored, file_offset, items in runs:
            buf = self._buffer(stored)
            got = os.preadv(self._pack_fd(pack), [buf], start)
            if got < stored:
                pos = 0
                for cid, length, _raw, _comp in items:
                    pos += length
                    if pos > got:
                        raise ChecksumMismatch(f"object {cid.hex()} in pack {pack}: short read")
            if self._key is not None:  # open every chunk; then decode the payloads as a run
                buf, items = self._open_run(buf, pack, items)
            if items[0][3] == DELTA:
                cid, length, raw, comp = items[0]
                deltas.append((cid, Location(pack, start, length, raw, CHUNK, comp), bytes(buf),
                               file_offset))
                continue
            out = self._decode_run(buf, pack, items)
            if self._key is not None:  # opened: each tag proved its payload is its id's
                for (cid, _length, raw, _comp), data in zip(items, out, strict=True):
                    if len(data) != raw:  # the index's raw length is not sealed
                        raise ChecksumMismatch(
                            f"object {cid.hex()} in pack {pack}: {len(data)} bytes, not {raw}")
                pwritev_all(fd, out, file_offset)
                continue
            for (cid, _length, raw, _comp), data in zip(items, out, strict=True):
                if len(data) != raw or blake3.blake3(data).digest() != cid:
                    raise ChecksumMismatch(f"object {cid.hex()} in pack {pack}: checksum mismatch")
            pwritev_all(fd, out, file_offset)
        if deltas:
            self._write_deltas(fd, deltas)

    def _write_deltas(self, fd: int, deltas: list[tuple[bytes, Location, bytes, int]]) -> None:
        """Rebuild, verify and write delta chunks read by ``_write_runs`` (sources looked up
        in one query; consecutive chunks written with one ``pwritev``)."""
        parsed: list[delta.Delta | None] = []
        wanted: set[bytes] = set()
        for _cid, loc, payload, _off in deltas:
            try:
                d = delta.parse(payload, loc.raw_length)
                wanted.update(d.sources)
            except CorruptObject:
                d = None  # rebuild names the damaged object
            parsed.append(d)
        locations = self.repo.index.lookup_many(list(wanted))
        cache: dict[bytes, bytes] = {}
        out: list[bytes | bytearray] = []
        at = end = -1
        for (cid, loc, payload, file_offset), d in zip(deltas, parsed, strict=True):
            data = self._reader.rebuild(cid, loc, payload, locations=locations, cache=cache,
                                        parsed=d)
            if file_offset != end:
                if out:
                    pwritev_all(fd, out, at)
                out, at = [], file_offset
            out.append(data)
            end = file_offset + len(data)
        if out:
            pwritev_all(fd, out, at)

    def _open_run(self, buf: memoryview, pack: str, items: list[tuple[bytes, int, int, int]]
                  ) -> tuple[memoryview, list[tuple[bytes, int, int, int]]]:
        """An encrypted store's run read into ``buf``: its chunks' payloads, opened, in one
        buffer, and the items with their payloads' lengths."""
        key = self._key
        assert key is not None
        out = getattr(self._local, "opened", None)
        if out is None or len(out) < len(buf):  # a second per-thread buffer, reused
            out = self._local.opened = memoryview(bytearray(max(len(buf), 2 * RUN_MAX)))
        try:
            at, opened = key.open_run(CHUNK, buf, items, out)
        except CorruptObject as exc:
            raise ChecksumMismatch(f"{exc} (in pack {pack})") from None
        return out[:at], opened

    def _decode_run(self, buf: memoryview, pack: str, items: list[tuple[bytes, int, int, int]]
                    ) -> list[Any]:
        """The plaintexts of a run read into ``buf`` (not yet verified): raw chunks are
        views of ``buf``; zstd chunks are decompressed a group at a time, in one call per
        group that releases the GIL once (``multi_decompress_to_buffer``)."""
        out: list[Any] = []
        group: list[int] = []  # indexes of the zstd chunks of the current group
        group_raw = 0
        pos = 0
        for k, (_cid, length, raw, comp) in enumerate(items):
            if comp == ZSTD:
                if group and group_raw + raw > DECOMPRESS_GROUP:
                    self._decompress(buf, pack, items, group, out)
                    group, group_raw = [], 0
                group.append(k)
                group_raw += raw
                out.append(pos)  # replaced by the plaintext
            else:
                out.append(buf[pos : pos + length])
            pos += length
        if group:
            self._decompress(buf, pack, items, group, out)
        return out

    def _decompress(self, buf: memoryview, pack: str, items: list[tuple[bytes, int, int, int]],
                    group: list[int], out: list[Any]) -> None:
        """Decompress the zstd chunks ``group`` of a run (``out[k]`` holds each one's offset
        in ``buf``) into ``out``."""
        frames = array.array("Q")  # (offset, length) of each frame in buf
        sizes = array.array("Q")
        for k in group:
            frames.append(out[k])
            frames.append(items[k][1])
            sizes.append(items[k][2])
        dctx = self._dctx()
        try:
            plain = dctx.multi_decompress_to_buffer(
                zstandard.BufferWithSegments(buf, frames.tobytes()),
                decompressed_sizes=sizes.tobytes(), threads=1)
        except zstandard.ZstdError:  # find and name the damaged object
            for k in group:
                cid, length, raw, _comp = items[k]
                try:
                    dctx.decompress(buf[out[k] : out[k] + length], max_output_size=raw)
                except zstandard.ZstdError as exc:
                    raise ChecksumMismatch(f"object {cid.hex()} in pack {pack}: does not "
                                           f"decompress ({exc})") from exc
            raise ChecksumMismatch(f"pack {pack}: the objects from {items[group[0]][0].hex()} "
                                   "on do not decompress together") from None
        for j, k in enumerate(group):
            out[k] = plain[j]

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def _buffer(self, size: int) -> memoryview:
        """A per-thread read buffer of at least ``size`` bytes, reused across runs."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:  # a run ends past RUN_MAX by up to one chunk
            buf = self._local.buf = memoryview(bytearray(max(size, 2 * RUN_MAX)))
        return buf[:size]

    def _pack_fd(self, pack: str) -> int:
        with self._fds_lock:
            fd = self._fds.get(pack)
            if fd is None:
                try:
                    fd = os.open(pack_path(self.repo.packs_dir, pack), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise ObjectMissing(f"pack {pack} is missing") from None
                self._fds[pack] = fd
            return fd


def _zero_chunk_ids(max_size: int, key: Any = None) -> dict[int, bytes]:
    """BLAKE3 ids (keyed, with an encrypted store's ``key``) of all-zero chunks of each
    page-multiple length up to ``max_size``."""
    sizes = set(range(PAGE, max_size + 1, PAGE)) | {max_size}
    zeros = bytes(max_size)
    view = memoryview(zeros)
    hasher = hash_bytes if key is None else key.object_id
    return {n: hasher(view[:n]) for n in sorted(sizes)}
