"""A restore from the store without checking the page files out (issue 32).

``checkout_except_pages`` writes a commit's images into a fresh directory, all but the page
files (``pages-*.img``: nearly all of a kernel's bytes), and ``StorePages`` serves those from
the store on a unix socket in that directory, which the helper is told of
(``RestoreArgs.page_source``; infinijup_helper/page_source.py has the wire format). The
helper asks for the few pages CRIU restores itself at once, and for the rest as the kernel
touches them or as CRIU's page daemon streams them in behind the running kernel. Each range
is read from the chunks that hold it, verified as a checkout verifies them.

The pages are served by a process of the server's user (``StorePagesProcess``, running
``main``), not by the server: a server that restarts while a woken kernel's memory streams in
must not end that kernel, and the chunks are decoded off the server's event loop. The process
may be started ahead, before any restore needs it (the engine keeps one ready while a kernel
hibernates): its imports and the store's opening (about 0.4 s on a 2-core VM) are then off the
wake's path. Told a restore's page files, it binds the socket, looks up their chunks and opens
the packs that hold them before the restore starts, so the remote tier's eviction or a gc
meanwhile cannot take them from under the stream. The helper checks that the socket's peer is
the caller. Two connections (faults, the stream); the process ends when the helper lets go (the
memory is back, or the restore failed), or, once told the restore is over, at once if nobody
connected; one started ahead and never used ends when its server lets go of it or ends. An
encrypted store is unlocked again in that process (from the environment, as every process of
the store).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import RestoreFailed
from ..store.checkout import Materializer
from ..store.errors import ObjectMissing
from ..store.faults import crashpoint
from ..store.packs import DELTA, decode_payload
from ..store.reader import ObjectReader
from ..store.thinned import refuse_thinned

log = logging.getLogger(__name__)

SOCKET = "pages.sock"
CACHE_CHUNKS = 256  # single chunks kept (about 8 MiB): faults ask page by page near each other
RUN = 1 << 20  # stored bytes read at once
PARALLEL = 1 << 20  # a request this large is decoded on the pool, run by run
THREADS = 2


def is_page_file(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


def checkout_except_pages(repo, commit_id: str, target: Path,  # noqa: ANN001
                          on_pages: Callable[[dict[str, str]], None]) -> None:
    """Write the commit's images into ``target`` (created, must not exist) except its page
    files, whose blob ids by name go to ``on_pages`` first (``target`` exists then)."""
    commit = repo.get_commit(commit_id)
    refuse_thinned(repo, commit.id)
    os.mkdir(target, 0o700)
    entries = list(repo.get_tree(commit.tree))
    pages = {e.name: e.id for e in entries if e.kind == "file" and is_page_file(e.name)}
    if pages:
        on_pages(pages)
    with Materializer(repo) as m:
        for entry in entries:
            if entry.kind == "file" and entry.name in pages:
                continue
            if entry.kind == "file":
                m.file(entry, target / entry.name)
            elif entry.kind == "dir":
                os.mkdir(target / entry.name, 0o700)
                m.tree(entry.id, target / entry.name)
                os.chmod(target / entry.name, entry.mode)
            else:
                os.symlink(entry.target, target / entry.name)


def pages_worth_serving(repo, commit_id: str, min_bytes: int) -> bool:  # noqa: ANN001
    """Whether the commit's page files hold ``min_bytes`` or more: below, a checkout is
    quicker than the serving process's start and the chunks' lookups."""
    commit = repo.get_commit(commit_id)
    return sum(e.size for e in repo.get_tree(commit.tree)
               if e.kind == "file" and is_page_file(e.name)) >= min_bytes


def checkout_serving_pages(repo, commit_id: str, target: Path,  # noqa: ANN001
                           take: Callable[[], StorePagesProcess] | None = None
                           ) -> StorePagesProcess | None:
    """The small images checked out into ``target`` while a serving process (``take()``'s,
    one started ahead, or a new one) looks the page files' chunks up; that process, ready
    (None: the commit has no page files)."""
    served: list[StorePagesProcess] = []

    def serve(pages: dict[str, str]) -> None:
        source = take() if take is not None else StorePagesProcess(repo.path)
        served.append(source)
        try:
            source.serve(pages, target / SOCKET)
        except OSError:  # it ended meanwhile: a new one
            served.append(source := StorePagesProcess(repo.path))
            source.serve(pages, target / SOCKET)

    try:
        checkout_except_pages(repo, commit_id, target, serve)
        if served:
            served[-1].wait_ready()
    except BaseException:
        for source in served:
            source.stop_listening()
        raise
    return served[-1] if served else None


class _Blob:
    def __init__(self, repo, blob_id: str) -> None:  # noqa: ANN001
        self.size, self.chunks = repo.get_blob_chunks(blob_id)
        self.locs = repo.index.lookup_many(self.chunks)
        missing = [c for c in self.chunks if c not in self.locs]
        if missing:
            raise ObjectMissing(f"chunk {missing[0].hex()} is not in the store")
        self.starts, at = [], 0
        for c in self.chunks:
            self.starts.append(at)
            at += self.locs[c].raw_length


class StorePagesProcess:
    """The server's side of a serving process: started at once (its imports, the store
    opened), given one restore's page files by ``serve``, ready after ``wait_ready``."""

    def __init__(self, store: Path | str, *, ahead: bool = False) -> None:
        self.started_ahead = ahead  # before any restore asked for it (SpareServer)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from infinijup.engine.store_pages import main; main()",
             str(store)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            start_new_session=True)  # not the server's: a server restart leaves it be

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serve(self, pages: dict[str, str], where: Path) -> None:
        """The page files' blob ids by name, to serve on a socket the process binds at
        ``where`` (OSError: the process has ended)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"pages": pages, "socket": str(where)}).encode()
                              + b"\n")
        self.proc.stdin.flush()

    def wait_ready(self) -> None:
        """Until the process has opened the store and the packs (RestoreFailed if it could
        not); meanwhile the server checks the small images out."""
        assert self.proc.stdout is not None
        said = self.proc.stdout.readline().decode(errors="replace").strip()
        if said != "ready":
            self.proc.kill()
            self.proc.wait()
            raise RestoreFailed(f"restore failed: the store cannot serve the snapshot's pages "
                                f"({said or 'its process ended'}); the kernel was not touched",
                                reason="checkout_failed")

    def stop_listening(self) -> None:
        """The restore is over (or it was never given one): the process serves the helper's
        connection, or ends."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass


class SpareServer:
    """At most one serving process started ahead, kept while ``ahead(True)`` says a restore
    with pages from the store is likely (a kernel hibernates)."""

    def __init__(self, store: Callable[[], Path | str]) -> None:
        self.store = store  # the store's path, asked when a process starts
        self.wanted = False
        self._spare: StorePagesProcess | None = None
        self._lock = threading.Lock()

    @property
    def kept(self) -> StorePagesProcess | None:
        return self._spare

    def ahead(self, wanted: bool) -> None:
        """Start one now (if none lives), or let the one kept go."""
        with self._lock:
            self.wanted = wanted
            gone, self._spare = (None, self._spare) if wanted else (self._spare, None)
            if wanted and (self._spare is None or not self._spare.alive()):
                self._spare = StorePagesProcess(self.store(), ahead=True)
        if gone is not None:
            gone.stop_listening()

    def refill(self) -> None:
        """After a restore took the one kept: the next, if still wanted."""
        if self.wanted:
            self.ahead(True)

    def take(self) -> StorePagesProcess:
        """The one kept, if it lives, else a new one."""
        with self._lock:
            spare, self._spare = self._spare, None
        return spare if spare is not None and spare.alive() else StorePagesProcess(self.store())


def main() -> None:
    """The serving process: ``argv[1]``: the store's path; stdin: the page files' blob ids and
    the socket's path (a JSON line), then end-of-file once the restore is over."""
    repo, failed = None, None
    try:
        from ..store import Repository

        repo = Repository.open(sys.argv[1])
    except Exception as exc:  # noqa: BLE001 - said once a restore asks
        failed = f"{type(exc).__name__}: {exc}"
    line = sys.stdin.buffer.readline()
    if not line:
        return  # never needed: the server let it go, or ended
    spec = json.loads(line)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        if failed is not None:
            raise RuntimeError(failed)
        listener.bind(spec["socket"])
        listener.listen(1)
        pages = StorePages(repo, spec["pages"])
    except Exception as exc:  # noqa: BLE001 - said to the server, which refuses the restore
        print(f"{type(exc).__name__}: {exc}", flush=True)
        return
    print("ready", flush=True)
    ready, _, _ = select.select([listener, sys.stdin], [], [])
    if listener not in ready:  # the restore is over: a connection the helper made is queued
        listener.setblocking(False)
    try:
        first, _ = listener.accept()
    except BlockingIOError:
        return  # the helper never connected (the restore failed before)
    conns = [first]
    listener.settimeout(30)  # the helper connects twice (faults, the stream), one after the other
    try:
        conns.append(listener.accept()[0])
    except OSError:
        pass
    listener.close()
    threads = []
    for i, conn in enumerate(conns):  # the helper's faults first, then its stream
        conn.setblocking(True)
        threads.append(threading.Thread(target=pages.serve, args=(conn, i == 1)))
        threads[-1].start()
    for t in threads:
        t.join()
    pages.close()


class StorePages:
    """Serves the page files of one restore from the store (see the module docs)."""

    def __init__(self, repo, pages: dict[str, str]) -> None:  # noqa: ANN001
        self.reader = ObjectReader(repo)
        self.files = {name: _Blob(repo, blob) for name, blob in pages.items()}
        # every pack opened now: one the remote tier evicts or gc removes while the pages
        # stream stays readable through its descriptor
        for blob in self.files.values():
            for loc in blob.locs.values():
                self.reader.pack_fd(loc.pack)
        self.served = 0
        self.error: str | None = None
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="store-pages")

    def serve(self, conn: socket.socket, stream: bool = False) -> None:
        """Answer the helper's asks until it lets go."""
        try:
            with conn:
                f = conn.makefile("rb")
                while head := f.read(4):
                    name = f.read(min(struct.unpack("<I", head)[0], 64)).decode()
                    offset, length = struct.unpack("<QQ", f.read(16))
                    if stream:
                        crashpoint("store_pages_stream")  # tests: the process dies mid-stream
                    conn.sendall(self.read(name, offset, length))
                    self.served += length
        except Exception as exc:  # noqa: BLE001 - the helper sees the connection end
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("serving a restore's pages from the store: %s", self.error)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()

    def read(self, name: str, offset: int, length: int) -> bytes | memoryview:
        blob = self.files[name]
        if offset + length > blob.size:
            raise ValueError(f"{name}: {offset}+{length} is past its {blob.size} bytes")
        end = offset + length
        first = bisect.bisect_right(blob.starts, offset) - 1
        last = bisect.bisect_left(blob.starts, end)  # chunks [first, last) hold the range
        runs = self._runs(blob, first, last)
        if length >= PARALLEL and len(runs) > 1:
            parts = list(self._pool.map(lambda r: self._decode(blob, r), runs))
        else:
            parts = [self._decode(blob, r) for r in runs]
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        skip = offset - blob.starts[first]
        return memoryview(joined)[skip:skip + length]  # the bytes asked, not copied again

    def _runs(self, blob: _Blob, first: int, last: int) -> list[tuple[int, int]]:
        """Chunks [first, last) cut into runs of neighbours in one pack (one read each),
        at most RUN bytes; a cached chunk or a delta is a run of its own."""
        runs: list[tuple[int, int]] = []
        i = first
        while i < last:
            j, loc = i + 1, blob.locs[blob.chunks[i]]
            size = loc.length
            if loc.compression != DELTA and blob.chunks[i] not in self._cache:
                while j < last:
                    nxt = blob.locs[blob.chunks[j]]
                    if (nxt.pack != loc.pack or nxt.offset != loc.offset + size
                            or nxt.compression == DELTA or size + nxt.length > RUN
                            or blob.chunks[j] in self._cache):
                        break
                    size += nxt.length
                    j += 1
            runs.append((i, j))
            i = j
        return runs

    def _decode(self, blob: _Blob, run: tuple[int, int]) -> bytes:
        """The plaintext of a run of chunks, each verified (as a checkout verifies them)."""
        i, j = run
        if j - i == 1:
            return self._chunk(blob, i)
        first = blob.locs[blob.chunks[i]]
        size = sum(blob.locs[blob.chunks[k]].length for k in range(i, j))
        stored = os.pread(self.reader.pack_fd(first.pack), size, first.offset)
        if len(stored) != size:
            raise ObjectMissing(f"pack {first.pack}: short read")
        out, at, view = [], 0, memoryview(stored)
        for k in range(i, j):
            oid = blob.chunks[k]
            loc = blob.locs[oid]
            payload = view[at:at + loc.length]  # a raw chunk's bytes are not copied
            at += loc.length
            if self.reader.repo.key is not None:
                payload = self.reader.open(oid, loc, payload)
            out.append(decode_payload(payload, oid, loc.compression, loc.raw_length,
                                      f"object {oid.hex()} in pack {loc.pack}",
                                      self.reader.repo.key))
        return b"".join(out)

    def _chunk(self, blob: _Blob, i: int) -> bytes:
        """One chunk, decoded and verified; kept a while (faults ask near each other)."""
        oid = blob.chunks[i]
        data = self._cache.get(oid)
        if data is None:
            data = self.reader.read(oid, blob.locs[oid])
            with self._lock:
                self._cache[oid] = data
                if len(self._cache) > CACHE_CHUNKS:
                    self._cache.popitem(last=False)
        return data
