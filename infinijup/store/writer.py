"""Streaming ingest: bytes in, deduplicated compressed chunks out, using every core.

Pipeline for one stream (``Writer.add_stream``)::

    main thread            worker threads (blake3 and zstd release the GIL)
    read 8 MiB block  -->  chunker.scan(block)              candidate cut points
    Splitter picks cuts
    batch ~4 MiB      -->  BLAKE3 each chunk, skip ids already stored, zstd the rest
    append new chunks to the open pack (in stream order), rotate packs at pack_size

The main thread only reads, picks cut points and writes; everything proportional to the
data size runs in the pool. A ``Writer`` holds the store lock *shared* for its whole life,
which keeps ``gc`` (exclusive) away from chunks it dedups against or is writing.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, TypeVar

import zstandard

from .chunking import Candidates, Splitter
from .errors import InvalidTree, ObjectMissing
from .faults import crashpoint
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
from .packs import RAW, ZSTD, PackWriter

if TYPE_CHECKING:
    from .objects import Commit
    from .repository import Repository

BLOCK = 8 << 20  # read size; a multiple of the page size
BATCH = 4 << 20  # bytes of chunks per hashing/compression job

T = TypeVar("T")


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
    files: int = 0


class Writer:
    """Adds file contents and trees to the store; see module docs. Use as a context manager."""

    def __init__(self, repo: Repository, *, threads: int | None = None) -> None:
        self.repo = repo
        self.threads = max(1, threads or os.cpu_count() or 1)
        self.stats = WriteStats()
        self._lock = FileLock(repo.lock_path, shared=True, timeout=repo.lock_timeout).acquire()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ijstore") \
            if self.threads > 1 else None
        self._local = threading.local()
        self._pack: PackWriter | None = None
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="ijstore-finish")
        self._finishing: deque[Future[int]] = deque()
        self._written: set[bytes] = set()  # ids this writer put in packs
        self._written_lock = threading.Lock()
        self._buffers: list[bytearray] = []  # recycled read buffers
        self._closed = False
        cfg = repo.config
        self._level = cfg.compression_level
        self._min_saving = cfg.min_saving

    # -- public API ------------------------------------------------------------------------

    def add_stream(self, src: IO[bytes] | Iterable[bytes]) -> Blob:
        """Store the bytes of a binary file object or an iterable of bytes; return its Blob."""
        self._check_open()
        return self._ingest(src)

    def add_file(self, path: str | os.PathLike[str]) -> Blob:
        """Store the content of the file at ``path``."""
        with open(path, "rb", buffering=0) as f:
            return self.add_stream(f)

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
        """Make every object written so far durable and indexed (waits for finishing packs)."""
        self._rotate()
        while self._finishing:
            self.stats.stored_bytes += self._finishing.popleft().result()

    def _rotate(self) -> None:
        """Hand the open pack to the finisher thread (fsync, rename, index) and go on."""
        if self._pack is not None and self._pack.entries:
            pack, self._pack = self._pack, None
            self._finishing.append(self._finisher.submit(self._finish_pack, pack))

    def _finish_pack(self, pack: PackWriter) -> int:
        name, _path, size = pack.finish()
        crashpoint("after_pack")
        self.repo.index.add_pack(name, size, pack.entries)
        crashpoint("after_index")
        return size

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
        if self._pack is not None:
            self._pack.abort()
            self._pack = None
        for fut in self._finishing:
            fut.exception()  # wait; a failed pack is garbage for gc
        self._finishing.clear()
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
        self._finisher.shutdown(wait=True)
        self._lock.release()

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        fut: Future[T] = Future()
        fut.set_result(fn(*args))
        return fut

    def _ingest(self, src: IO[bytes] | Iterable[bytes]) -> Blob:
        ids, total = _StreamIngest(self, src).run()
        self.stats.logical_bytes += total
        body = encode_blob(total, ids)
        blob_id = hash_bytes(body)
        self._put_meta(BLOB, blob_id, body)
        return Blob(blob_id.hex(), total)

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

    def _process(self, chunks: list[memoryview | bytes]) -> list[tuple[bytes, int, Any, int]]:
        """Worker job: hash every chunk, compress those the store does not have yet."""
        ids = [hash_bytes(c) for c in chunks]
        with self._written_lock:
            fresh = [i for i in ids if i not in self._written]
        stored = self.repo.index.known(fresh) if fresh else set()
        out: list[tuple[bytes, int, Any, int]] = []
        for oid, chunk in zip(ids, chunks, strict=True):
            if oid in stored or oid in self._written:
                out.append((oid, len(chunk), None, RAW))
            else:
                payload, comp = self._encode(chunk)
                out.append((oid, len(chunk), payload, comp))
        return out

    def _put_many(self, items: list[tuple[int, bytes, Any, int, int]]) -> Future[int] | None:
        """Append objects (type, id, payload, compression, raw length) to the open pack,
        starting a new pack whenever one reaches the configured size. Returns the future of
        the last write (the finisher runs writes in order), or None if nothing was written."""
        limit = self.repo.config.pack_size
        last: Future[int] | None = None
        while items:
            if self._pack is None:
                self._pack = PackWriter(self.repo.packs_dir, self.repo.tmp_dir)
            room = limit - self._pack.size
            take, used = 0, 0
            while take < len(items) and used < room:
                used += len(items[take][2])
                take += 1
            group, items = items[:take], items[take:]
            # the (single, FIFO) finisher thread writes, so reading and hashing go on meanwhile
            last = self._finisher.submit(_write_views, self._pack, self._pack.reserve(group))
            self._finishing.append(last)
            while len(self._finishing) > 8:
                self.stats.stored_bytes += self._finishing.popleft().result()
            with self._written_lock:
                self._written.update(item[1] for item in group)
            if self._pack.size >= limit:
                self._rotate()
        return last

    def _put_meta(self, typ: int, oid: bytes, body: bytes) -> None:
        with self._written_lock:
            if oid in self._written:
                return
        if self.repo.index.known([oid]):
            return
        payload, comp = self._encode(body)
        self._put_many([(typ, oid, payload, comp, len(body))])

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
        tree_id = hash_bytes(body)
        self._put_meta(TREE, tree_id, body)
        return tree_id.hex(), total


def _write_views(pack: PackWriter, views: list[memoryview]) -> int:
    pack.write(views)
    return 0


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


def _slice(window: deque[tuple[int, memoryview]], start: int, end: int) -> memoryview | bytes:
    """Bytes [start, end) of the stream from the blocks in ``window`` (zero-copy if possible)."""
    parts: list[memoryview] = []
    for off, block in window:
        b_end = off + len(block)
        if b_end <= start:
            continue
        if off >= end:
            break
        parts.append(block[max(start - off, 0) : min(end, b_end) - off])
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _StreamIngest:
    """One stream through the pipeline (see module docs).

    Blocks read from a file are recycled: a block is reused once the splitter has passed
    it, every batch holding its chunks has been drained and the pack writes that may
    reference it (raw chunks are written straight from the block) have completed.
    """

    def __init__(self, writer: Writer, src: IO[bytes] | Iterable[bytes]) -> None:
        self.w = writer
        self.chunker = writer.repo.chunker
        self.splitter = Splitter(self.chunker)
        self.src = src
        self.window: deque[tuple[int, memoryview]] = deque()  # blocks not yet fully cut
        self.scans: deque[tuple[int, memoryview, Future[Candidates]]] = deque()
        self.jobs: deque[tuple[int, Future[list[tuple[bytes, int, Any, int]]]]] = deque()
        self.writes: deque[tuple[int, Future[int] | None]] = deque()
        self.held: deque[tuple[int, bytearray]] = deque()  # (end offset, pooled buffer)
        self.free = writer._buffers  # shared by the writer's streams
        self.written_end = 0
        self.ids: list[bytes] = []
        self.batch: list[memoryview | bytes] = []
        self.batch_bytes = 0
        self.total = 0

    def run(self) -> tuple[list[bytes], int]:
        """Ingest the whole stream; return (chunk ids, total bytes)."""
        chunker = self.chunker
        offset, tail = 0, b""
        for block in self._blocks():
            self.scans.append((offset, block, self.w._submit(chunker.scan, block, offset, tail)))
            offset += len(block)
            if chunker.overlap:
                tail = bytes(block[-chunker.overlap :])
            while len(self.scans) > 2:
                self._take_scan()
        while self.scans:
            self._take_scan()
        self._emit(self.splitter.finish())
        if self.batch:
            self._submit_batch()
        self._drain(0)
        if self.total != offset:
            raise AssertionError(f"ingest lost bytes: {self.total} != {offset}")
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
        end = 0
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
            if n < BLOCK:
                return

    def _recycle(self) -> None:
        while self.writes and (self.writes[0][1] is None or self.writes[0][1].done()):
            self.written_end = self.writes.popleft()[0]
        limit = min(self.written_end, self.splitter.start)
        while self.held and self.held[0][0] <= limit and not self.jobs_hold(self.held[0][0]):
            self.free.append(self.held.popleft()[1])

    def jobs_hold(self, end: int) -> bool:
        """Whether a batch not yet written may still reference bytes before ``end``."""
        return bool(self.batch) and self.splitter.start - self.batch_bytes < end

    def _take_scan(self) -> None:
        off, block, fut = self.scans.popleft()
        self.window.append((off, block))
        self._emit(self.splitter.feed(len(block), fut.result()))

    def _emit(self, ends: list[int]) -> None:
        start = self.chunk_start
        for end in ends:
            self.batch.append(_slice(self.window, start, end))
            self.batch_bytes += end - start
            start = end
            self.chunk_start = start
            if self.batch_bytes >= BATCH:
                self._submit_batch()
                self._drain(self.w.threads * 2)
        while self.window and self.window[0][0] + len(self.window[0][1]) <= start:
            self.window.popleft()

    chunk_start = 0

    def _submit_batch(self) -> None:
        self.jobs.append((self.chunk_start, self.w._submit(self.w._process, self.batch)))
        self.batch, self.batch_bytes = [], 0

    def _drain(self, limit: int) -> None:
        w = self.w
        while len(self.jobs) > limit:
            end, job = self.jobs.popleft()
            result = job.result()
            new: list[tuple[int, bytes, Any, int, int]] = []
            fresh: set[bytes] = set()
            for oid, raw_len, payload, comp in result:
                self.ids.append(oid)
                self.total += raw_len
                if payload is not None and oid not in w._written and oid not in fresh:
                    fresh.add(oid)
                    new.append((CHUNK, oid, payload, comp, raw_len))
            w.stats.chunks += len(result)
            w.stats.new_chunks += len(new)
            self.writes.append((end, w._put_many(new)))


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


def entries_from_dir(writer: Writer, path: Path) -> Dir:
    """Ingest the directory tree at ``path`` into ``writer``; return it as a Dir entry."""
    entries: dict[str, Any] = {}
    with os.scandir(path) as it:
        items = sorted(it, key=lambda e: e.name)
    for item in items:
        st = item.stat(follow_symlinks=False)
        if item.is_symlink():
            entries[item.name] = Symlink(os.readlink(item.path))
        elif item.is_dir(follow_symlinks=False):
            entries[item.name] = entries_from_dir(writer, Path(item.path))
        elif item.is_file(follow_symlinks=False):
            entries[item.name] = File(writer.add_file(item.path), st.st_mode & 0o7777)
        else:
            raise InvalidTree(f"{item.path}: only files, directories and symlinks are stored")
    return Dir(entries, os.stat(path).st_mode & 0o7777)
