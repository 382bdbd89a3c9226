"""A restore from the store without checking the page files out (issue 32).

``checkout_except_pages`` writes a commit's images into a fresh directory, all but the page
files (``pages-*.img``: nearly all of a kernel's bytes), and ``StorePages`` serves those from
the store on a unix socket in that directory, which the helper is told of
(``RestoreArgs.page_source``; infinijup_helper/page_source.py has the wire format). The
helper asks for the few pages CRIU restores itself at once, and for the rest as the kernel
touches them or as CRIU's page daemon streams them in behind the running kernel. Each range
is read from the chunks that hold it, verified as a checkout verifies them.

The pages are served by a process of the server's user (``StorePagesProcess``, running
``main``, started ahead of the restore that uses it: ``start_spare``), not by the server: a
server that restarts while a woken kernel's memory streams in must not end that kernel, and
the chunks are decoded off the server's event loop. The helper checks that the socket's peer
is the caller. Two connections (faults, the stream); the process ends when the helper lets go
(the memory is back, or the restore failed), or, once told the restore is over, at once if
nobody connected. It keeps open every pack that holds the pages, so the remote tier's eviction
or a gc meanwhile cannot take them from under the stream. Where a page file's blob has a
layout (store/layouts.py) the process is ready as soon as it has read it: the packs are opened
behind the restore (one query), and each ask locates its chunks (and those just past them). A
chunk the store lacks then fails the restore while it runs, as a pack removed mid-stream does,
rather than before it starts; a pack evicted in the second or so before it is opened does too.
Without a layout (an older store, an encrypted one) every chunk is located first, as before.
An encrypted store is unlocked again in that process (from the environment, as every process
of the store).
"""

from __future__ import annotations

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

import numpy as np

from ..errors import RestoreFailed
from ..store import layouts
from ..store.errors import CorruptObject, ObjectMissing
from ..store.faults import crashpoint
from ..store.index import Index, Location
from ..store.packs import DELTA, decode_payload
from ..store.reader import ObjectReader
from ..store.thinned import refuse_thinned

log = logging.getLogger(__name__)

SOCKET = "pages.sock"
CACHE_CHUNKS = 256  # single chunks kept (about 8 MiB): faults ask page by page near each other
RUN = 1 << 20  # stored bytes read at once
PARALLEL = 1 << 20  # a request this large is decoded on the pool, run by run
THREADS = 2
AHEAD = 256  # chunks located past an ask's (the stream asks in file order)
BEHIND_SLICE = 16384  # chunks whose packs are found and opened at once, behind the restore
SWITCH_S = 0.0005  # Python's thread switch: what an ask waits at most for the lock


def is_page_file(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


def checkout_except_pages(repo, commit_id: str, target: Path,  # noqa: ANN001
                          on_pages: Callable[[dict[str, str]], None]) -> None:
    """Write the commit's images into ``target`` (created, must not exist) except its page
    files, whose blob ids by name go to ``on_pages`` first (``target`` exists then)."""
    from ..store.checkout import Materializer  # here: the serving process needs none of it

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


def checkout_serving_pages(repo, commit_id: str, target: Path) -> StorePagesProcess | None:  # noqa: ANN001
    """The small images checked out into ``target`` while the page files' server starts;
    the server, ready (None: the commit has no page files)."""
    served: list[StorePagesProcess] = []
    try:
        checkout_except_pages(repo, commit_id, target, lambda pages: served.append(
            StorePagesProcess(repo, pages, target / SOCKET)))
        if served:
            served[0].wait_ready()
    except BaseException:
        for source in served:
            source.stop_listening()
        raise
    return served[0] if served else None


class _Blob:
    """A page file's chunks: where each starts (``starts``, ``lengths``) and where each is
    stored (``locs``). With a layout (store/layouts.py) the starts are known at once and
    the locations are filled in as asks need them; without one, every chunk is looked up
    here, as the serving process starts."""

    def __init__(self, repo, blob_id: str) -> None:  # noqa: ANN001
        self.size, self.chunks = repo.get_blob_chunks(blob_id)
        self.locs: dict[bytes, Location] = {}
        known = None if repo.key is not None else layouts.starts(
            repo.index.layout(bytes.fromhex(blob_id)), len(self.chunks), self.size)
        self.behind = known is not None  # locations to look up behind the restore
        if known is not None:
            self.starts, self.lengths = known
            return
        self.locs = repo.index.lookup_many(self.chunks)
        missing = [c for c in self.chunks if c not in self.locs]
        if missing:
            raise ObjectMissing(f"chunk {missing[0].hex()} is not in the store")
        self.lengths = np.fromiter((self.locs[c].raw_length for c in self.chunks),
                                   dtype=np.int64, count=len(self.chunks))
        self.starts = np.cumsum(self.lengths) - self.lengths


class StorePagesProcess:
    """The server's side: the serving process told where to listen (``where``) and what to
    serve (``wait_ready``: it listens, its packs are open). The process is the one started
    ahead (``start_spare``), its imports done, where there is one."""

    def __init__(self, repo, pages: dict[str, str], where: Path) -> None:  # noqa: ANN001
        self.proc = _take_spare() or _spawn()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"store": str(repo.path), "pages": pages,
                                              "socket": str(where)}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # it died before it was told: wait_ready says so
            pass

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
        """The restore is over: the process serves the helper's connection, or ends. The next
        restore's process is started now, while nothing waits for it."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        start_spare()


# One serving process started ahead of the restore that will use it, with the environment it
# was started in (a process started in another environment, say another store's key, is not
# used). Its start (Python and the store's modules, about 0.3 s on the 2-core VM) is then off
# the restore's path. It waits for its first line on stdin and ends at end-of-file (its
# server stopped or ended).
_spare_lock = threading.Lock()
_spare: tuple[subprocess.Popen, dict[str, str]] | None = None


def _spawn() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from infinijup.engine.store_pages import main; main()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        start_new_session=True)  # not the server's: a server restart leaves it be


def _end(proc: subprocess.Popen) -> None:
    """A process never told anything: its stdin closed, it ends (reaped by a thread: it may
    still be importing, and nothing waits for that)."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
    threading.Thread(target=proc.wait, daemon=True, name="store-pages-spare-end").start()


def _take_spare() -> subprocess.Popen | None:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    if _usable(spare):
        return spare[0]
    _end(spare[0])
    return None


def _usable(spare: tuple[subprocess.Popen, dict[str, str]]) -> bool:
    """Alive, and started in the environment the server has now."""
    return spare[0].poll() is None and spare[1] == dict(os.environ)


def start_spare() -> None:
    """A serving process started for the next restore from the store, unless one waits."""
    global _spare
    with _spare_lock:
        old = _spare
        if old is not None and _usable(old):
            return
        _spare = (_spawn(), dict(os.environ))
    if old is not None:
        _end(old[0])


def stop_spare() -> None:
    """The process started ahead ended (the server stops)."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        _end(spare[0])


def main() -> None:
    """The serving process: on stdin the store's path, the page files' blob ids and the path
    of the socket to listen on (a JSON line), then end-of-file once the restore is over. It
    may wait for that line a long time (started ahead: ``start_spare``); end-of-file before
    it: its server ended, and so does it."""
    from ..store import Repository

    # the asks wait for Python's lock while the packs are opened behind: not 5 ms each time
    sys.setswitchinterval(SWITCH_S)
    line = sys.stdin.buffer.readline()
    if not line:
        return
    try:
        spec = json.loads(line)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(spec["socket"])
        listener.listen(1)
        pages = StorePages(Repository.open(spec["store"]), spec["pages"])
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
        # every pack opened as soon as its chunks are looked up: one the remote tier evicts
        # or gc removes while the pages stream stays readable through its descriptor
        for blob in self.files.values():
            self._open_packs(blob.locs.values())
        self.served = 0
        self.error: str | None = None
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="store-pages")
        self._stop = threading.Event()
        self._behind = threading.Thread(target=self._look_up_behind, daemon=True,
                                        name="store-pages-lookups")
        self._behind.start()

    def _open_packs(self, locs) -> None:  # noqa: ANN001 - Iterable[Location]
        for pack in {loc.pack for loc in locs}:
            self.reader.pack_fd(pack)

    def _look_up(self, blob: _Blob, first: int, last: int) -> None:
        """Chunks [first, last) of ``blob`` located (those not yet; and up to AHEAD chunks
        past them, where the stream asks next), their packs opened; ObjectMissing for one
        of [first, last) that the store lacks, CorruptObject for one whose length is not the
        layout's."""
        ids = [c for c in blob.chunks[first:last] if c not in blob.locs]
        if not ids:
            return
        ahead = min(len(blob.chunks), last + AHEAD)
        ids += [c for c in blob.chunks[last:ahead] if c not in blob.locs]
        found = self.reader.repo.index.lookup_many(ids)
        for k in range(first, ahead):
            c = blob.chunks[k]
            loc = found.get(c) or blob.locs.get(c)
            if loc is None:
                if k >= last:  # ahead: for the ask that needs it to say
                    continue
                raise ObjectMissing(f"chunk {c.hex()} is not in the store")
            if loc.raw_length != blob.lengths[k]:
                raise CorruptObject(f"chunk {c.hex()}: {loc.raw_length} bytes, its blob's "
                                    f"layout says {blob.lengths[k]}")
        self._open_packs(found.values())
        blob.locs.update(found)

    def _look_up_behind(self) -> None:
        """Behind the restore, the packs that hold the chunks of the files with a layout,
        opened (the asks locate their chunks themselves), through a connection of its own
        and in statements that answer a row each, so that the asks wait neither for the
        index's lock nor for Python's. Locating every chunk here instead, a row each, slowed
        the first faults of a 16 GiB restore on two cores (its first answer 1.8 s after the
        restore, against 0.9 s)."""
        behind = [blob for blob in self.files.values() if blob.behind]
        if not behind:
            return
        repo = self.reader.repo
        index = None
        try:
            # a connection of its own: the asks' lookups do not queue behind its statements
            index = Index(repo.index_path, key=repo.key)
            missing = 0
            for blob in behind:
                # a slice at a time: each step below holds Python's lock as one call, and
                # over a 16 GiB file's 450,000 chunks at once the restore's first asks waited
                # 0.11 s for it (GPU host)
                for at in range(0, len(blob.chunks), BEHIND_SLICE):
                    if self._stop.is_set():
                        return
                    uniq = list(dict.fromkeys(blob.chunks[at:at + BEHIND_SLICE]))
                    packs, found = index.packs_holding(uniq)
                    for pack in sorted(packs):
                        self.reader.pack_fd(pack)
                    missing += len(uniq) - found
            if missing:
                log.warning("%d of a restore's chunks are not in the store: the asks for "
                            "them fail", missing)
        except Exception as exc:  # noqa: BLE001 - an ask for those chunks fails with it too
            log.warning("opening a restore's packs: %s", exc)
        finally:
            if index is not None:
                index.close()

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
        self._stop.set()
        self._behind.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()

    def read(self, name: str, offset: int, length: int) -> bytes | memoryview:
        blob = self.files[name]
        if offset + length > blob.size:
            raise ValueError(f"{name}: {offset}+{length} is past its {blob.size} bytes")
        end = offset + length
        first = int(np.searchsorted(blob.starts, offset, side="right")) - 1
        last = int(np.searchsorted(blob.starts, end, side="left"))  # [first, last) hold it
        if blob.behind:
            self._look_up(blob, first, last)
        runs = self._runs(blob, first, last)
        if length >= PARALLEL and len(runs) > 1:
            parts = list(self._pool.map(lambda r: self._decode(blob, r), runs))
        else:
            parts = [self._decode(blob, r) for r in runs]
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        skip = offset - int(blob.starts[first])
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
