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

The index is asked for a file's chunks a slice at a time, so the first runs are written
while it answers for the next. A plain store's large files (``PROCESS_MIN``) are written by
worker processes instead of threads, on machines of 4 cores or more: the parent plans the
runs, asks the disk to read each job's runs as it queues it, and keeps the delta runs on
its threads (docs/store.md, "Checkout does the reverse").
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import delta
from .checkout_workers import Workers
from .chunking import PAGE
from .errors import CheckoutTargetNotEmpty, ChecksumMismatch, CorruptObject, ObjectMissing
from .index import Location
from .objects import CHUNK, Commit, TreeEntry, hash_bytes
from .packs import DELTA, pwritev_all
from .reader import ObjectReader
from .runs import RUN_MAX, Run, RunDecoder, verify
from .thinned import refuse_thinned
from .writer import default_threads

if TYPE_CHECKING:
    from .repository import Repository

BATCH = 8 << 20  # bytes of file content per read/verify/write job
LOOKUP_SLICE = 16384  # chunks looked up in the index at a time (about 0.5 GB of a file)
# A plain store's files from this size on are written by worker processes, one per core (at
# most MAX_PROCESSES): threads share one GIL, and at 8 or 16 threads on 16 cores a 6 GB
# checkout kept 3.4-4.6 cores busy (bench/checkout_probe.py, docs/benchmarks.md).
PROCESS_MIN = 1 << 30
MAX_PROCESSES = 16


def checkout_dir(repo: Repository, ref: str, path: str | os.PathLike[str], *,
                 threads: int | None = None, leave_out: frozenset[str] = frozenset()) -> Commit:
    """Materialize the tree of ``ref`` at ``path`` (absent or an empty directory), but for
    the top-level entries named in ``leave_out``.

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
            m.tree(commit.tree, tmp, leave_out)
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
        cores = os.cpu_count() or 1
        # on 2 cores the GIL is not what limits threads, and processes cost their start
        self.processes = threads or (min(cores, MAX_PROCESSES) if cores >= 4 else 1)
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="ijcheckout") if n > 1 else None
        self._decoder = RunDecoder()
        self._local = threading.local()
        self._key = repo.key
        self._zero_ids = _zero_chunk_ids(repo.chunker.max_size, self._key)
        self._reader = ObjectReader(repo)  # the packs' descriptors; delta chunks' sources

    def __enter__(self) -> Materializer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers and close pack files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._reader.close()

    def tree(self, tree_id: str, dest: Path, leave_out: frozenset[str] = frozenset()) -> None:
        """Create every entry of tree ``tree_id`` (but those named in ``leave_out``) inside
        the existing directory ``dest``."""
        for entry in self.repo.get_tree(tree_id):
            if entry.name in leave_out:
                continue
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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        jobs: deque[Future[None]] = deque()
        procs: Workers | None = None
        try:
            if self._key is None and size >= PROCESS_MIN and self.processes > 1:
                procs = Workers(self.processes)
            submit = (lambda fd, batch: [self._submit(fd, batch)]) if procs is None \
                else self._in_processes(procs, path)
            offset = self._plan(self._located(chunks, path.name), fd, jobs, submit)
            while jobs:
                jobs.popleft().result()
            if offset != size:
                raise CorruptObject(f"blob {entry.id}: chunks hold {offset} bytes, not {size}")
            os.ftruncate(fd, size)
        finally:
            for job in jobs:  # on error: let running jobs end before closing their file
                job.exception()
            os.close(fd)
            if procs is not None:
                procs.close()
        os.chmod(path, entry.mode)

    def _in_processes(self, procs: Workers, path: Path
                      ) -> Callable[[int, list[Run]], list[Future[None]]]:
        """A job's submitter for ``procs``: its plain runs go to a worker process (which
        opens ``path`` itself), its delta runs (which read other chunks through the index)
        to this process's threads."""
        packs = str(self.repo.packs_dir)

        def submit(fd: int, batch: list[Run]) -> list[Future[None]]:
            # the disk starts reading each job's runs as it is queued (up to two jobs per
            # worker ahead), not when a worker gets to them
            for pack, start, stored, _at, _items in batch:
                os.posix_fadvise(self._reader.pack_fd(pack), start, stored, os.POSIX_FADV_WILLNEED)
            plain = [run for run in batch if run[4][0][3] != DELTA]
            deltas = [run for run in batch if run[4][0][3] == DELTA]
            return ([procs.submit(packs, str(path), plain)] if plain else []) \
                + ([self._submit(fd, deltas)] if deltas else [])

        return submit

    def _located(self, chunks: list[bytes], name: str) -> Iterator[tuple[bytes, Any]]:
        """The file's chunks with their locations, looked up ``LOOKUP_SLICE`` at a time, so
        the workers write the first runs while the index answers for the next ones (a
        10 GB file's ~500K lookups took about 1 s before the first write)."""
        for i in range(0, len(chunks), LOOKUP_SLICE):
            part = chunks[i : i + LOOKUP_SLICE]
            locs = self.repo.index.lookup_many(part)
            for cid in part:
                loc = locs.get(cid)
                if loc is None:
                    raise ObjectMissing(f"file {name}: chunk {cid.hex()} is not in the store")
                yield cid, loc

    def _plan(self, located: Iterator[tuple[bytes, Any]], fd: int, jobs: deque[Future[None]],
              submit: Callable[[int, list[Run]], list[Future[None]]]) -> int:
        """Cut the file into runs, submit them in jobs of ~BATCH bytes; return the size."""
        zero_ids = self._zero_ids
        limit = 2 * max(self.threads, self.processes)  # jobs in flight
        batch: list[Run] = []
        batch_bytes = 0
        run: list[tuple[bytes, int, int, int]] = []
        run_pack, run_start, run_end, run_file, run_raw = "", 0, -1, 0, 0
        run_delta = False
        offset = 0
        for cid, loc in located:
            pack, off, length, raw, _typ, comp = loc
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
                        jobs.extend(submit(fd, batch))
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
            jobs.extend(submit(fd, batch))
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
        dec = self._decoder
        for pack, start, stored, file_offset, items in runs:
            buf = dec.read(self._reader.pack_fd(pack), pack, start, stored, items)
            if self._key is not None:  # open every chunk; then decode the payloads as a run
                buf, items = self._open_run(buf, pack, items)
            if items[0][3] == DELTA:
                cid, length, raw, comp = items[0]
                deltas.append((cid, Location(pack, start, length, raw, CHUNK, comp), bytes(buf),
                               file_offset))
                continue
            out = dec.decode(buf, pack, items)
            if self._key is not None:  # opened: each tag proved its payload is its id's
                for (cid, _length, raw, _comp), data in zip(items, out, strict=True):
                    if len(data) != raw:  # the index's raw length is not sealed
                        raise ChecksumMismatch(
                            f"object {cid.hex()} in pack {pack}: {len(data)} bytes, not {raw}")
            else:
                verify(pack, items, out)
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


def _zero_chunk_ids(max_size: int, key: Any = None) -> dict[int, bytes]:
    """BLAKE3 ids (keyed, with an encrypted store's ``key``) of all-zero chunks of each
    page-multiple length up to ``max_size``."""
    sizes = set(range(PAGE, max_size + 1, PAGE)) | {max_size}
    zeros = bytes(max_size)
    view = memoryview(zeros)
    hasher = hash_bytes if key is None else key.object_id
    return {n: hasher(view[:n]) for n in sorted(sizes)}
