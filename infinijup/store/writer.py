"""Streaming ingest: bytes in, deduplicated compressed chunks out, using every core.

Pipeline for one stream (``Writer.add_stream``)::

    main thread                  worker threads (numpy, blake3, zstd release the GIL)
    readinto 8 MiB block    -->  chunker.scan(block): candidate cut points; all-zero pages
    Splitter picks the cuts
    jobs of ~4 MiB          -->  BLAKE3 every chunk (all-zero ones: a cached BLAKE3 of
                                 zeros), drop ids already stored or written,
                                 zstd the rest where it pays (probing incompressible runs)
    drain jobs in order: ids, new chunks reserved in the open pack
                            -->  io threads pwritev the reserved ranges
    full pack               -->  seal thread: header, fsync, rename, fsync dir, index rows

The main thread does per *block* work only (reading, picking cuts, slicing the block into
jobs by offsets): everything per *chunk* runs in the workers, and the pack bookkeeping is
columnar (lists extended per job, header and index rows built in bulk). Writing and sealing
run on their own threads, so neither hashing nor reading waits for the disk; a pack is
still fsynced and renamed before its index rows are added, and a commit waits for every
pack it needs. A ``Writer`` holds the store lock *shared* for its whole life, which keeps
``gc`` (exclusive) away from chunks it dedups against or is writing.

Compression: a chunk is stored zstd only if that saves ``min_saving`` (5%), as before.
zstd costs more than hashing on data it cannot shrink, so a job whose first chunk does not
compress *probes* its other chunks: a 1/8 sample of each (512 bytes of every 4 KiB page) is
compressed, and a chunk whose sample saves under 1% is stored raw without compressing it.
A job whose first chunk compresses compresses them all (no probing cost on compressible
data). zstd runs over all the chunks of a job in one call (``multi_compress_to_buffer``):
one GIL release per job instead of one per chunk, which matters with many cores.

Page deltas: a stream given a ``base`` (the parent snapshot's version of the file) gets a
``BaseMap`` of it (basemap.py); a job then tries to store each of its new chunks as a page
delta of the parent's pages at the same place (delta.py) before compressing it whole.
Without a base (a first snapshot) nothing of this runs.
"""

from __future__ import annotations

import bisect
import os
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, TypeVar

import blake3
import numpy as np
import zstandard

from . import layouts
from .basemap import BaseMap
from .chunking import PAGE, Candidates, Splitter
from .errors import InvalidTree, ObjectMissing, StoreError
from .faults import crashpoint
from .index import Location
from .lock import FileLock
from .objects import (
    BLOB,
    CHUNK,
    TREE,
    Blob,
    File,
    Symlink,
    TreeEntry,
    check_name,
    encode_blob,
    encode_tree,
    hash_bytes,
)
from .packs import DELTA, RAW, ZSTD, PackWriter
from .reader import ObjectReader

if TYPE_CHECKING:
    from .objects import Commit
    from .repo_view import RepoView

BLOCK = 8 << 20  # read size; a multiple of the page size
BATCH = 4 << 20  # bytes of chunks per hashing/compression job
PROBE_MIN = 16 << 10  # chunks shorter than this are compressed without probing
PROBE_PIECE = 512  # bytes sampled from each 4 KiB page of a probed chunk
PROBE_AT = 1536  # where in each page the sampled piece starts
PROBE_SAVING = 0.01  # a sample that saves less than this marks the chunk incompressible
MAX_PENDING_WRITES = 16  # pack writes queued before the main thread waits
INDEX_BATCH = 16384  # objects of sealed packs indexed together, in one transaction

MAX_DEFAULT_THREADS = 8  # see default_threads
MIN_DELTA_FILE = 256 << 10  # smaller files are stored without looking at their parent

T = TypeVar("T")


def default_threads() -> int:
    """Worker threads when the caller does not say: one per core, at most 8.

    Every chunk costs at least one GIL hand-off (its BLAKE3 call releases the GIL), and with
    more threads the hand-offs contend: on 16 cores, 8 workers ingest and check out faster
    than 16 (docs/benchmarks.md, ## Store).
    """
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_THREADS))

#: A run of chunks inside one buffer: (buffer, stream offset of the buffer, stream offset
#: where the first chunk starts, stream offsets where each chunk ends, the buffer's zero-page
#: prefix counts or None when it has no all-zero page).
Segment = tuple[memoryview, int, int, list[int], "np.ndarray | None"]
#: What a job returns: (every chunk id in order, their total length, and for the chunks
#: to store: ids, payloads, compressions, raw lengths).
JobResult = tuple[list[bytes], int, list[bytes], list[Any], list[int], list[int]]

@dataclass(frozen=True)
class Dir:
    """A sub-directory entry for ``commit_tree``: a name -> entry mapping and its mode."""

    entries: Mapping[str, Any]
    mode: int = 0o755


@dataclass
class WriteStats:
    """What a writer has done since its last commit."""

    logical_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    new_chunks: int = 0
    delta_chunks: int = 0  # new chunks stored as page deltas
    files: int = 0
    read_bytes: int = 0  # of the files stored (less than logical: incremental.py)


class Writer:
    """Adds file contents and trees to the store; see module docs. Use as a context manager."""

    def __init__(self, repo: RepoView, *, threads: int | None = None) -> None:
        self.repo = repo
        self.threads = max(1, threads or default_threads())
        self.stats = WriteStats()
        self._lock = FileLock(repo.lock_path, shared=True, timeout=repo.lock_timeout).acquire()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ijstore") \
            if self.threads > 1 else None
        self._io = ThreadPoolExecutor(max(1, min(4, self.threads // 4)),
                                      thread_name_prefix="ijstore-io")
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="ijstore-seal")
        self._local = threading.local()
        self._pack: PackWriter | None = None
        self._pack_writes: list[Future[None]] = []  # writes into the open pack
        self._writes: deque[Future[None]] = deque()  # every write not yet waited for
        self._sealing: deque[Future[int]] = deque()  # packs being sealed -> stored bytes
        self._unindexed: list[PackWriter] = []  # sealed packs not indexed yet (seal thread)
        self._written: set[bytes] = set()  # ids this writer put in packs
        self._written_lock = threading.Lock()
        self._layouts: list[tuple[bytes, bytes]] = []  # large blobs' (layouts.py), to index
        self._buffers: list[bytearray] = []  # recycled read buffers
        self._zero_ids: dict[int, bytes] = {}
        self._key = repo.key  # an encrypted store's: keyed ids, payloads sealed
        self._id = hash_bytes if self._key is None else self._key.object_id
        self._reader: ObjectReader | None = None  # reads parents' chunks for deltas
        self._closed = False
        cfg = repo.config
        self._level = cfg.compression_level
        self._min_saving = cfg.min_saving

    # -- public API ------------------------------------------------------------------------

    def add_stream(self, src: IO[bytes] | Iterable[bytes], *, base: Blob | None = None) -> Blob:
        """Store the bytes of a binary file object or an iterable of bytes; return its Blob.

        ``base``: the same file in the parent snapshot, if any. Chunks that differ from it
        in a few pages are then stored as page deltas of its chunks (see delta.py); the
        result reads back the same either way.
        """
        self._check_open()
        return self._ingest(src, base)

    def add_file(self, path: str | os.PathLike[str], *, base: Blob | None = None) -> Blob:
        """Store the content of the file at ``path`` (``base`` as for add_stream)."""
        with open(path, "rb", buffering=0) as f:
            return self.add_stream(f, base=base)

    def add_bytes(self, data: bytes) -> Blob:
        """Store ``data`` (convenience for small contents)."""
        return self.add_stream([data])

    def add_tree(self, entries: Mapping[str, Any]) -> tuple[str, int]:
        """Store a tree built from ``entries``; return (tree id, total file bytes).

        Values: :class:`Blob` (a 0644 file), :class:`File`, :class:`Symlink`, :class:`Dir` or
        a nested mapping (a 0755 directory). Every blob must already be in the store.
        """
        self._check_open()
        blobs: list[Blob] = []
        _collect_blobs(entries, blobs)
        ids = list({bytes.fromhex(b.id) for b in blobs})
        with self._written_lock:
            unknown = [i for i in ids if i not in self._written]
        missing = set(unknown) - self.repo.index.known(unknown)
        if missing:
            raise ObjectMissing(f"blob {min(missing).hex()} is not in the store")
        return self._write_tree(entries)

    def commit(self, entries: Mapping[str, Any], **kwargs: Any) -> Commit:
        """Build a tree from ``entries`` and commit it (see ``Repository.commit_tree``)."""
        return self.repo.commit_tree(entries, writer=self, **kwargs)

    def flush(self) -> None:
        """Make every object written so far durable and indexed (waits for sealing packs)."""
        self._rotate()
        while self._writes:
            self._writes.popleft().result()
        while self._sealing:
            self.stats.stored_bytes += self._sealing.popleft().result()
        self._sealer.submit(self._index_sealed).result()

    def take_stats(self) -> WriteStats:
        """Return the stats since the last call and start counting afresh."""
        stats, self.stats = self.stats, WriteStats()
        return stats

    def close(self) -> None:
        """Flush, stop the workers and release the lock."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._shutdown()

    def abort(self) -> None:
        """Drop the unfinished pack, stop the workers and release the lock."""
        if self._closed:
            return
        for fut in list(self._writes) + list(self._sealing):
            fut.exception()  # wait; a failed pack is garbage for gc
        self._writes.clear()
        self._sealing.clear()
        if self._pack is not None:
            self._pack.abort()
            self._pack = None
        self._shutdown()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("writer is closed")

    def _shutdown(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._sealer.shutdown(wait=True)
        if self._reader is not None:
            self._reader.close()
        self._lock.release()

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        fut: Future[T] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits, as a pool would
            fut.set_exception(exc)
        return fut

    def _ingest(self, src: IO[bytes] | Iterable[bytes], base: Blob | None) -> Blob:
        ingest = _StreamIngest(self, src, self._base_map(base))
        ids, total = ingest.run()
        return self._blob(ids, ingest.ends, total)

    def _base_map(self, base: Blob | None, known: tuple[list[bytes], np.ndarray] | None = None
                  ) -> BaseMap | None:
        """The parent's map for page deltas (``known``: its chunk ids and ends, if read)."""
        if base is None or base.size < MIN_DELTA_FILE or not self.repo.config.page_deltas:
            return None
        if self._reader is None:
            self._reader = ObjectReader(self.repo)
        if known is not None:
            return BaseMap(self.repo, self._reader, *known)
        return BaseMap.build(self.repo, self._reader, base.id)

    def _blob(self, ids: list[bytes], ends: array, total: int) -> Blob:
        """The blob of ``ids`` (chunks ending at ``ends``), stored with its layout."""
        self.stats.logical_bytes += total
        body = encode_blob(total, ids)
        blob_id = self._id(body)
        self._put_meta(BLOB, blob_id, body)
        if self._key is None and len(ids) >= layouts.MIN_CHUNKS and len(ends) == len(ids):
            row = (blob_id, layouts.encode(np.frombuffer(ends, dtype=np.int64)))
            with self._written_lock:
                self._layouts.append(row)  # indexed with the packs (_index_sealed)
        return Blob(blob_id.hex(), total)

    # -- packs -----------------------------------------------------------------------------

    def _rotate(self) -> None:
        """Hand the open pack to the seal thread (once its writes are done) and go on."""
        if self._pack is not None and self._pack.count:
            pack, writes = self._pack, self._pack_writes
            self._pack, self._pack_writes = None, []
            self._sealing.append(self._sealer.submit(self._finish_pack, pack, writes))

    def _finish_pack(self, pack: PackWriter, writes: list[Future[None]]) -> int:
        """Seal thread: make a pack durable and visible; index sealed packs in batches."""
        for w in writes:
            w.result()  # a failed write fails the pack (and the commit waiting for it)
        _name, _path, size = pack.finish()
        crashpoint("after_pack")
        self._unindexed.append(pack)
        if sum(p.count for p in self._unindexed) >= INDEX_BATCH:
            self._index_sealed()
        return size

    def _index_sealed(self) -> None:
        """Seal thread: add the index rows of every sealed pack not indexed yet, in one
        transaction (the packs are durable already: packs before index rows)."""
        packs, self._unindexed = self._unindexed, []
        if packs:
            self.repo.index.add_pack_rows(
                [(p.name, p.total_size, p.count, p.index_rows) for p in packs])
        with self._written_lock:
            rows, self._layouts = self._layouts, []
        self.repo.index.add_layouts(rows)
        for _ in packs:
            crashpoint("after_index")

    def _put(self, typ: int, ids: list[bytes], payloads: list[Any], comps: list[int],
             raws: list[int]) -> Future[None] | None:
        """Append objects (given as columns) to the open pack, starting a new pack whenever
        one reaches the configured size; their bytes are written by the io threads. Returns
        the future of the last write, or None if nothing was written."""
        limit = self.repo.config.pack_size
        last: Future[None] | None = None
        start, n = 0, len(ids)
        while start < n:
            if self._pack is None:
                self._pack = PackWriter(self.repo.packs_dir, self.repo.tmp_dir, key=self._key)
            pack = self._pack
            room = limit - pack.size
            end, used = start, 0
            while end < n and used < room:
                used += len(payloads[end])
                end += 1
            views, offset = pack.reserve_columns(
                [typ] * (end - start), ids[start:end], payloads[start:end], comps[start:end],
                raws[start:end])
            last = self._io.submit(pack.write_at, views, offset)
            self._pack_writes.append(last)
            self._writes.append(last)
            start = end
            if pack.size >= limit:
                self._rotate()
        while len(self._writes) > MAX_PENDING_WRITES:
            self._writes.popleft().result()
        while self._sealing and self._sealing[0].done():
            self.stats.stored_bytes += self._sealing.popleft().result()
        return last

    def _put_meta(self, typ: int, oid: bytes, body: bytes) -> None:
        with self._written_lock:
            if oid in self._written:
                return
            self._written.add(oid)
        if self.repo.index.known([oid]):
            return
        payload, comp = self._encode(body)
        if self._key is not None:
            payload = self._key.seal(oid, typ, comp, payload)
        self._put(typ, [oid], [payload], [comp], [len(body)])

    # -- chunks (worker threads) -----------------------------------------------------------

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "cctx", None)
        if c is None:
            c = self._local.cctx = zstandard.ZstdCompressor(level=self._level)
        return c

    def _encode(self, data: memoryview | bytes) -> tuple[memoryview | bytes, int]:
        """Compress where it pays (saves at least ``min_saving``), else keep raw."""
        packed = self._compressor().compress(data)
        if len(packed) <= len(data) * (1 - self._min_saving):
            return packed, ZSTD
        return data, RAW

    def _zero_id(self, n: int) -> bytes:
        """BLAKE3 of ``n`` zero bytes (computed once per length)."""
        oid = self._zero_ids.get(n)
        if oid is None:
            oid = self._zero_ids[n] = self._id(bytes(n))
        return oid

    def _encode_chunks(self, chunks: list[memoryview]) -> tuple[list[Any], list[int]]:
        """(payloads, compressions) for new chunks, compressing where it pays.

        zstd runs over many chunks per call (``multi_compress_to_buffer``, which releases
        the GIL once for all of them). The job's first chunk decides the mode: if it
        compresses, every chunk is compressed (and kept raw where that does not save
        ``min_saving``); if not, every further chunk is *probed* first (its sample is
        compressed) and only those whose sample shrinks are compressed.
        """
        cctx = self._compressor()
        keep = 1 - self._min_saving
        payloads: list[Any] = list(chunks)
        comps = [RAW] * len(chunks)
        first = cctx.compress(chunks[0])
        if len(first) <= len(chunks[0]) * keep:
            payloads[0], comps[0] = first, ZSTD
            todo = list(range(1, len(chunks)))
        else:
            todo = [k for k in range(1, len(chunks)) if len(chunks[k]) < PROBE_MIN]
            probe = [k for k in range(1, len(chunks)) if len(chunks[k]) >= PROBE_MIN]
            if probe:
                samples = [_sample(chunks[k]) for k in probe]
                packed = cctx.multi_compress_to_buffer(samples, threads=1)
                todo += [k for j, k in enumerate(probe)
                         if len(packed[j]) <= len(samples[j]) * (1 - PROBE_SAVING)]
                todo.sort()
        if todo:
            packed = cctx.multi_compress_to_buffer([chunks[k] for k in todo], threads=1)
            for j, k in enumerate(todo):
                p = packed[j]
                if len(p) <= len(chunks[k]) * keep:
                    payloads[k], comps[k] = p, ZSTD
        return payloads, comps

    def _process(self, segments: list[Segment], bmap: BaseMap | None = None) -> JobResult:
        """Worker job: hash every chunk, store those the store does not have yet as page
        deltas (with a base) or compressed where it pays."""
        chunks: list[memoryview] = []
        starts: list[int] = []  # stream offset of each chunk (for deltas)
        zero: list[bool] | None = None  # which chunks are all zeros, if any is
        for view, base, start, ends, zprefix in segments:
            if zprefix is not None:
                flags = _zero_chunks(zprefix, start - base, ends, base)
                if zero is None:
                    zero = [False] * len(chunks)
                zero += flags
            elif zero is not None:
                zero += [False] * len(ends)
            s = start - base
            if bmap is not None:
                starts.append(start)
                starts += ends[:-1]
            for e in ends:
                e -= base
                chunks.append(view[s:e])
                s = e
        if self._key is not None:  # keyed ids (an encrypted store)
            keyed = self._key.object_id
            ids = [keyed(c) for c in chunks] if zero is None or not any(zero) else [
                self._zero_id(len(c)) if z else keyed(c)
                for c, z in zip(chunks, zero, strict=True)]
        elif zero is None or not any(zero):
            ids = [blake3.blake3(c).digest() for c in chunks]
        else:  # all-zero chunks: their BLAKE3 is known (one per length), skip hashing them
            zid = self._zero_id
            ids = [zid(len(c)) if z else blake3.blake3(c).digest()
                   for c, z in zip(chunks, zero, strict=True)]
        total = segments[-1][3][-1] - segments[0][2]  # segments are consecutive
        by_id = dict(zip(ids, chunks, strict=True))  # one per distinct id
        with self._written_lock:
            fresh = [i for i in by_id if i not in self._written]
        if fresh:
            stored = self.repo.index.known(fresh)
            if stored:
                fresh = [i for i in fresh if i not in stored]
        deltas = self._deltas(bmap, ids, chunks, starts, fresh) if bmap and fresh else {}
        whole = [i for i in fresh if i not in deltas] if deltas else fresh
        chunks = [by_id[i] for i in whole]
        payloads, comps = self._encode_chunks(chunks) if chunks else ([], [])
        raws = list(map(len, chunks))
        if deltas:  # back in stream order (checkout reads consecutive chunks in one go)
            enc = dict(zip(whole, zip(payloads, comps, raws, strict=True), strict=True))
            for i, payload in deltas.items():
                enc[i] = (payload, DELTA, len(by_id[i]))
            payloads, comps, raws = (list(col) for col in zip(*(enc[i] for i in fresh),
                                                              strict=True))
        if self._key is not None:  # sealed here, on the worker threads
            seal = self._key.seal
            payloads = [seal(i, CHUNK, c, p) for i, p, c in zip(fresh, payloads, comps,
                                                                strict=True)]
        return ids, total, fresh, payloads, comps, raws

    def _deltas(self, bmap: BaseMap, ids: list[bytes], chunks: list[memoryview],
                starts: list[int], fresh: list[bytes]) -> dict[bytes, bytes]:
        """Worker: page-delta payloads of the new chunks that are mostly their parent's."""
        assert self._reader is not None
        reader = self._reader
        ends = [s + len(c) for s, c in zip(starts, chunks, strict=True)]
        want = set(fresh)
        where: dict[bytes, int] = {}
        for k, oid in enumerate(ids):
            if oid in want and oid not in where:
                where[oid] = k
        cache: dict[bytes, bytes | None] = {}

        def source(sid: bytes, loc: Location) -> bytes | None:
            if sid not in cache:
                try:
                    cache[sid] = reader.read(sid, loc)
                except StoreError:
                    cache[sid] = None  # unreadable: its pages count as changed
            return cache[sid]

        out: dict[bytes, bytes] = {}
        cctx = self._compressor()
        for oid in fresh:
            if not bmap.worth_trying():
                continue
            k = where[oid]
            payload = None
            for place in bmap.places(ids, starts, ends, k):
                payload = bmap.encode(chunks[k], place, source, cctx, self._min_saving)
                if payload is not None:
                    out[oid] = payload
                    break
            bmap.record(payload is not None)
        return out

    def _write_tree(self, entries: Mapping[str, Any]) -> tuple[str, int]:
        out: list[TreeEntry] = []
        total = 0
        for name, value in entries.items():
            check_name(name)
            if isinstance(value, Blob):
                value = File(value)
            if isinstance(value, File):
                out.append(TreeEntry(name, "file", value.mode & 0o7777, value.blob.id,
                                     value.blob.size))
                total += value.blob.size
                self.stats.files += 1
            elif isinstance(value, Symlink):
                out.append(TreeEntry(name, "symlink", target=value.target))
            elif isinstance(value, (Dir, Mapping)):
                sub = value if isinstance(value, Dir) else Dir(value)
                sub_id, sub_total = self._write_tree(sub.entries)
                out.append(TreeEntry(name, "dir", sub.mode & 0o7777, sub_id))
                total += sub_total
            else:
                raise InvalidTree(f"entry {name!r}: unsupported value {type(value).__name__}")
        body = encode_tree(out)
        tree_id = self._id(body)
        self._put_meta(TREE, tree_id, body)
        return tree_id.hex(), total



def _collect_blobs(entries: Mapping[str, Any], out: list[Blob]) -> None:
    if not isinstance(entries, Mapping):
        raise InvalidTree(f"tree entries must be a mapping, not {type(entries).__name__}")
    for value in entries.values():
        if isinstance(value, Blob):
            out.append(value)
        elif isinstance(value, File):
            out.append(value.blob)
        elif isinstance(value, Dir):
            _collect_blobs(value.entries, out)
        elif isinstance(value, Mapping):
            _collect_blobs(value, out)



class _StreamIngest:
    """One stream through the pipeline (see module docs).

    Blocks read from a file are recycled: a block is reused once the splitter has passed
    it, every job holding its chunks has been drained, and the pack writes that may
    reference it (raw chunks are written straight from the block) have completed.
    """

    def __init__(self, writer: Writer, src: IO[bytes] | Iterable[bytes],
                 bmap: BaseMap | None = None, origin: int = 0) -> None:
        self.w = writer
        self.bmap = bmap
        self.chunker = writer.repo.chunker
        self.splitter = Splitter(self.chunker)
        # where the stream starts in its file (a chunk end of the file's stored version:
        # incremental.py); offsets below are the file's
        self.origin = origin
        self.splitter.start = self.splitter.avail = origin
        self.src = src
        # blocks not yet fully cut: (offset, block, zero-page prefix counts or None)
        self.window: deque[tuple[int, memoryview, np.ndarray | None]] = deque()
        self.scans: deque[tuple[int, memoryview, Future[tuple[Candidates, np.ndarray | None]]]] \
            = deque()
        self.jobs: deque[tuple[int, Future[JobResult]]] = deque()  # (end offset, job)
        self.writes: deque[tuple[int, Future[None] | None]] = deque()  # (end offset, write)
        self.held: deque[tuple[int, bytearray]] = deque()  # (end offset, pooled buffer)
        self.free = writer._buffers  # shared by the writer's streams
        self.written_end = origin
        self.chunk_start = origin
        self.ids: list[bytes] = []
        self.ends = array("q")  # where each chunk ends (layouts.py)
        self.total = 0

    def run(self) -> tuple[list[bytes], int]:
        """Ingest the whole stream; return (chunk ids, total bytes)."""
        chunker = self.chunker
        offset, tail = self.origin, b""
        for block in self._blocks():
            self.scans.append((offset, block, self.w._submit(_scan, chunker, block, offset, tail)))
            offset += len(block)
            if chunker.overlap:
                tail = bytes(block[-chunker.overlap :])
            while len(self.scans) > 2:
                self._take_scan()
        while self.scans:
            self._take_scan()
        self._cut(self.splitter.finish())
        self._drain(0)
        if self.total != offset - self.origin:
            raise AssertionError(f"ingest lost bytes: {self.total} != {offset - self.origin}")
        self.w.stats.read_bytes += self.total
        for _end, fut in self.writes:
            if fut is not None:
                fut.result()
        self.free.extend(buf for _end, buf in self.held)
        return self.ids, self.total

    def _blocks(self) -> Iterator[memoryview]:
        readinto = getattr(self.src, "readinto", None)
        if readinto is None:
            if hasattr(self.src, "read"):
                yield from _read_blocks(self.src)  # type: ignore[arg-type]
            else:
                yield from _reblock(self.src)  # type: ignore[arg-type]
            return
        end = self.origin
        while True:
            self._recycle()
            buf = self.free.pop() if self.free else bytearray(BLOCK)
            view = memoryview(buf)
            n = 0
            while n < BLOCK:
                got = readinto(view[n:])
                if not got:
                    break
                n += got
            if n:
                end += n
                self.held.append((end, buf))
                yield view[:n]
            else:
                self.free.append(buf)
            if n < BLOCK:
                return

    def _recycle(self) -> None:
        while self.writes and (self.writes[0][1] is None or self.writes[0][1].done()):
            self.written_end = self.writes.popleft()[0]
        limit = min(self.written_end, self.chunk_start)
        while self.held and self.held[0][0] <= limit:
            self.free.append(self.held.popleft()[1])

    def _take_scan(self) -> None:
        off, block, fut = self.scans.popleft()
        cands, zprefix = fut.result()
        self.window.append((off, block, zprefix))
        self._cut(self.splitter.feed(len(block), cands))

    def _cut(self, ends: list[int]) -> None:
        """Turn decided chunk ends into jobs of ~BATCH bytes (per block, not per chunk:
        the workers slice the chunks out of the block)."""
        if not ends:
            return
        self.ends.extend(ends)
        window = self.window
        start = self.chunk_start
        segments: list[Segment] = []
        seg_bytes = 0
        i, n = 0, len(ends)
        k = 0
        while i < n:
            while window[k][0] + len(window[k][1]) <= start:
                k += 1
            off, block, zprefix = window[k]
            b_end = off + len(block)
            j = bisect.bisect_right(ends, min(b_end, start + BATCH - seg_bytes), i, n)
            if j == i and ends[i] > b_end:  # this chunk spans blocks: copy it out
                data = memoryview(_join(window, k, start, ends[i]))
                segments.append((data, start, start, [ends[i]], None))
                seg_bytes += ends[i] - start
                start = ends[i]
                i += 1
            else:
                j = max(j, i + 1)  # one chunk larger than what is left of the batch
                segments.append((block, off, start, ends[i:j], zprefix))
                seg_bytes += ends[j - 1] - start
                start = ends[j - 1]
                i = j
            if seg_bytes >= BATCH or i == n:
                self._submit_job(segments, start)
                segments, seg_bytes = [], 0
        self.chunk_start = start
        while window and window[0][0] + len(window[0][1]) <= start:
            window.popleft()

    def _submit_job(self, segments: list[Segment], end: int) -> None:
        self.jobs.append((end, self.w._submit(self.w._process, segments, self.bmap)))
        self._drain(self.w.threads * 2)

    def _drain(self, limit: int) -> None:
        w = self.w
        while len(self.jobs) > limit:
            end, job = self.jobs.popleft()
            ids, total, new, payloads, comps, raws = job.result()
            self.ids += ids
            self.total += total
            w.stats.chunks += len(ids)
            if new:
                with w._written_lock:
                    written = w._written
                    if any(i in written for i in new):  # another job stored them meanwhile
                        keep = [k for k, i in enumerate(new) if i not in written]
                        new = [new[k] for k in keep]
                        payloads = [payloads[k] for k in keep]
                        comps = [comps[k] for k in keep]
                        raws = [raws[k] for k in keep]
                    written.update(new)
            w.stats.new_chunks += len(new)
            if self.bmap is not None:
                w.stats.delta_chunks += comps.count(DELTA)
            self.writes.append((end, w._put(CHUNK, new, payloads, comps, raws) if new else None))


def _sample(chunk: memoryview) -> bytes:
    """1/8 of a chunk for probing: PROBE_PIECE bytes of each 4 KiB page."""
    return b"".join([chunk[i : i + PROBE_PIECE]
                     for i in range(PROBE_AT, len(chunk) - PROBE_PIECE + 1, 4096)])


def _scan(chunker: Any, block: memoryview, offset: int, tail: bytes
          ) -> tuple[Candidates, np.ndarray | None]:
    """Worker job: candidate cuts of a block, and where its all-zero pages are."""
    return chunker.scan(block, offset, tail), _zero_prefix(block)


def _zero_prefix(block: memoryview) -> np.ndarray | None:
    """Prefix counts of all-zero pages of ``block`` (``p[i]`` = zero pages among its first
    ``i``), or None if it has none. Zero pages are common in memory images (and pagecdc
    cuts runs of them into many minimal chunks), so their chunks are worth not hashing."""
    npages = len(block) // PAGE
    if not npages:
        return None
    words = np.frombuffer(block, dtype=np.uint64, count=npages * (PAGE // 8))
    words = words.reshape(npages, PAGE // 8)
    cand = np.flatnonzero(words[:, 0] == 0)  # one word per page first: cheap
    if not len(cand):
        return None
    cand = cand[~words[cand].any(axis=1)]
    if not len(cand):
        return None
    flags = np.zeros(npages + 1, dtype=np.int32)
    flags[cand + 1] = 1
    return np.cumsum(flags, dtype=np.int32)


def _zero_chunks(zprefix: np.ndarray, start: int, ends: list[int], base: int) -> list[bool]:
    """Which chunks (``start``, then ``ends``, offsets relative to the buffer after
    subtracting ``base``) consist of whole all-zero pages."""
    e = np.asarray(ends, dtype=np.int64) - base
    s = np.empty_like(e)
    s[0] = start
    s[1:] = e[:-1]
    last = len(zprefix) - 1
    sp, ep = s // PAGE, np.minimum(e // PAGE, last)
    whole = ((s % PAGE) == 0) & ((e % PAGE) == 0) & (e // PAGE <= last)
    return (whole & (zprefix[ep] - zprefix[sp] == ep - sp)).tolist()


def _join(window: deque[tuple[int, memoryview, Any]], k: int, start: int, end: int) -> bytes:
    """Bytes [start, end) of the stream from the blocks ``window[k:]``."""
    parts: list[memoryview] = []
    for off, block, _z in list(window)[k:]:
        if off >= end:
            break
        parts.append(block[max(start - off, 0) : min(end, off + len(block)) - off])
    return b"".join(parts)


def _read_blocks(f: IO[bytes]) -> Iterator[memoryview]:
    while True:
        data = f.read(BLOCK)
        if not data:
            return
        parts = [data]
        got = len(data)
        while got < BLOCK:  # short read (pipe, socket): fill the block
            more = f.read(BLOCK - got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        yield memoryview(data if len(parts) == 1 else b"".join(parts))
        if got < BLOCK:
            return


def _reblock(chunks: Iterable[bytes]) -> Iterator[memoryview]:
    buf = bytearray()
    for piece in chunks:
        buf += piece
        while len(buf) >= BLOCK:
            yield memoryview(bytes(buf[:BLOCK]))
            del buf[:BLOCK]
    if buf:
        yield memoryview(bytes(buf))


def entries_from_dir(writer: Writer, path: Path, base_tree: str | None = None) -> Dir:
    """Ingest the directory tree at ``path`` into ``writer``; return it as a Dir entry.

    ``base_tree``: the parent snapshot's tree; a file gets the parent's file of the same
    path as its delta base (see Writer.add_stream).
    """
    entries: dict[str, Any] = {}
    base: dict[str, TreeEntry] = {}
    if base_tree is not None:
        try:
            base = {e.name: e for e in writer.repo.get_tree(base_tree)}
        except StoreError:
            base = {}  # an unreadable parent only costs the deltas
    with os.scandir(path) as it:
        items = sorted(it, key=lambda e: e.name)
    for item in items:
        st = item.stat(follow_symlinks=False)
        if item.is_symlink():
            entries[item.name] = Symlink(os.readlink(item.path))
        elif item.is_dir(follow_symlinks=False):
            old = base.get(item.name)
            entries[item.name] = entries_from_dir(
                writer, Path(item.path), old.id if old is not None and old.kind == "dir" else None)
        elif item.is_file(follow_symlinks=False):
            old = base.get(item.name)
            parent = Blob(old.id, old.size) if old is not None and old.kind == "file" else None
            entries[item.name] = File(writer.add_file(item.path, base=parent),
                                      st.st_mode & 0o7777)
        else:
            raise InvalidTree(f"{item.path}: only files, directories and symlinks are stored")
    return Dir(entries, os.stat(path).st_mode & 0o7777)
