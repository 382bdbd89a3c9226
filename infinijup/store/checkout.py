"""Materializing stored trees on disk, reading and verifying chunks on all cores."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from .chunking import PAGE
from .errors import CorruptObject, ObjectMissing
from .index import Location
from .objects import TreeEntry, hash_bytes
from .packs import decode_payload, pack_path

if TYPE_CHECKING:
    from .repository import Repository

BATCH = 8 << 20  # bytes of chunks per read/verify/write job


class Materializer:
    """Writes trees and files of one store; owns a thread pool and open pack handles."""

    def __init__(self, repo: Repository, *, threads: int | None = None) -> None:
        self.repo = repo
        n = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="ijcheckout") if n > 1 else None
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()
        self._zero_ids = _zero_chunk_ids(repo.chunker.max_size)

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
        missing = [c for c in chunks if c not in locs]
        if missing:
            raise ObjectMissing(f"file {path.name}: chunk {missing[0].hex()} is not in the store")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            jobs: list[Future[None]] = []
            batch: list[tuple[bytes, Location, int]] = []
            batch_bytes = 0
            offset = 0
            for cid in chunks:
                loc = locs[cid]
                if self._zero_ids.get(loc.raw_length) != cid:  # zero chunks become holes
                    batch.append((cid, loc, offset))
                    batch_bytes += loc.raw_length
                offset += loc.raw_length
                if batch_bytes >= BATCH:
                    jobs.append(self._submit(fd, batch))
                    batch, batch_bytes = [], 0
            if batch:
                jobs.append(self._submit(fd, batch))
            for job in jobs:
                job.result()
            if offset != size:
                raise CorruptObject(f"blob {entry.id}: chunks hold {offset} bytes, not {size}")
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        os.chmod(path, entry.mode)

    def _submit(self, fd: int, batch: list[tuple[bytes, Location, int]]) -> Future[None]:
        if self._pool is not None:
            return self._pool.submit(self._write_batch, fd, batch)
        fut: Future[None] = Future()
        self._write_batch(fd, batch)
        fut.set_result(None)
        return fut

    def _write_batch(self, fd: int, batch: list[tuple[bytes, Location, int]]) -> None:
        for cid, loc, offset in batch:
            payload = os.pread(self._pack_fd(loc.pack), loc.length, loc.offset)
            data = decode_payload(payload, cid, loc.compression, loc.raw_length,
                                  f"object {cid.hex()} in pack {loc.pack}")
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n

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


def _zero_chunk_ids(max_size: int) -> dict[int, bytes]:
    """BLAKE3 ids of all-zero chunks of each page-multiple length up to ``max_size``."""
    sizes = set(range(PAGE, max_size + 1, PAGE)) | {max_size}
    zeros = bytes(max_size)
    view = memoryview(zeros)
    return {n: hash_bytes(view[:n]) for n in sorted(sizes)}
