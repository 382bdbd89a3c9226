"""A restore whose page files are not on disk: the caller serves their bytes (issue 32).

The server keeps snapshots in its store; checking a 4 GiB kernel's page files out before a
restore costs seconds. Instead it checks out the small images, listens on a unix socket in
the images dir and names it (``RestoreArgs.page_source``). The helper then:

- connects to that socket through the images dir's descriptor and requires the peer to be
  the caller (``SO_PEERCRED``), so a socket another account put there serves nothing;
- makes each page file in the staging dir, full size and sparse, and fills in what CRIU's
  restore reads itself: the pages not marked lazy (and every page of a shared-memory
  pagemap). A whole restore (the caller cannot have a lazy one) fills in everything;
- for a lazy restore, answers CRIU's page daemon (``lazy-pages --page-server --ps-socket``)
  on a socketpair, in CRIU's page-server protocol, asking the source for each range the
  daemon wants. The daemon never talks to the caller: each of its requests is checked
  against the pagemaps (the process, the address, the count) before anything is asked, and
  the source's answer is only bytes of an exact, known length. This runs in a process of its
  own (page_proxy.py), so that the stream outlives a helper that dies or restarts.

Wire to the source, per range: ``u32`` name length, the page file's name (``pages-N.img``),
``u64`` offset, ``u64`` length; the answer is those bytes, in the order asked. The helper
connects twice: faults on one connection, the background stream on the other (page_proxy.py).
A short answer, a closed connection or a wrong name ends the stream: the daemon fails, the
tree is ended (lazy_pages.py), the reason recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from .criu import PE_LAZY, PE_PARENT, PE_PRESENT, image_names
from .page_proxy import PAGE, LazyMap, ask_bytes, read_exact, untrusted
from .proc import Caller

FILL_CHUNK = 8 << 20
ASK_BATCH = 64
# Lazy pages in runs (neighbouring pagemap entries) shorter than this are restored by CRIU
# itself, the shortest first, up to EAGER_TOTAL in all: the interpreter's heaps, stacks and
# small objects, which a restored kernel touches first. Left lazy, its first answer took
# about 1,500 faults, each a round trip through the daemon, the proxy and the source
# (0.2-0.5 ms each); filled in before the restore, they take a few asks (they lie before and
# after the large arrays in the page file).
EAGER_RUN = 16 << 20
EAGER_TOTAL = 64 << 20


def eager_entries(entries: list[tuple[int, int, int]]) -> set[int]:
    """Which lazy entries (their indexes) are restored by CRIU itself: those of runs of
    neighbouring lazy entries under ``EAGER_RUN``, the shortest runs first, up to
    ``EAGER_TOTAL`` bytes."""
    runs: list[list[int]] = []
    end = None
    for i, (vaddr, nr, flags) in enumerate(entries):
        if not (flags & PE_PRESENT and flags & PE_LAZY) or flags & PE_PARENT:
            end = None
            continue
        if vaddr != end:
            runs.append([])
        runs[-1].append(i)
        end = vaddr + nr * PAGE
    sized = sorted((sum(entries[i][1] for i in run) * PAGE, run) for run in runs)
    chosen: set[int] = set()
    total = 0
    for size, run in sized:
        if size >= EAGER_RUN or total + size > EAGER_TOTAL:
            break
        chosen.update(run)
        total += size
    return chosen


def _connect(images_fd: int, name: str, caller: Caller) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{images_fd}/{name}")
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != caller.uid:
            raise untrusted(f"{name} is served by uid {uid}, not by the caller")
    except OSError as exc:
        sock.close()
        raise untrusted(f"cannot connect to {name}: {exc.strerror}") from None
    except BaseException:
        sock.close()
        raise
    return sock


class PageSource:
    """The caller's connection, the staged page files and the daemon's lazy ranges."""

    def __init__(self, images_fd: int, name: str, caller: Caller) -> None:
        if not name or "/" in name or len(name) > 64 or name in (".", ".."):
            raise untrusted(f"bad socket name {name!r}")
        try:
            st = os.stat(name, dir_fd=images_fd, follow_symlinks=False)
        except OSError as exc:
            raise untrusted(f"{name}: {exc.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise untrusted(f"{name} is not a socket")
        # two connections: faults, and the stream (so a fault never waits behind it)
        self.sock = _connect(images_fd, name, caller)
        try:
            self.bulk = _connect(images_fd, name, caller)
        except BaseException:
            self.sock.close()
            raise
        self.maps: dict[int, LazyMap] = {}
        self.sizes: dict[str, int] = {}  # each lazily served page file's length
        self.proxy: subprocess.Popen | None = None
        self._err: int | None = None
        self._why: str | None = None

    # -- the staged page files

    def fill(self, criu: Any, staging_fd: int, owner: Caller, *, everything: bool) -> int:
        """Make each page file the pagemaps name (sparse, full size) in the staging dir and
        fill what the restore reads itself (``everything``: all of it); bytes made."""
        total = 0
        names = set(image_names(staging_fd))
        for pagemap in sorted(n for n in names if n.startswith("pagemap") and n.endswith(".img")):
            pages_id, entries = criu.pagemap_entries(staging_fd, pagemap)
            pages = f"pages-{pages_id}.img"
            if pages in names:
                raise untrusted(f"{pages} came with the images and from the source")
            task = pagemap.removeprefix("pagemap-").removesuffix(".img")
            lazy_ok = task.isdigit() and not everything
            made_eager = eager_entries(entries) if lazy_ok else set()
            if made_eager:  # CRIU's restore reads them itself, its daemon leaves them
                criu.clear_lazy(staging_fd, pagemap, made_eager)
            m = LazyMap(pages)
            eager: list[tuple[int, int]] = []  # (offset, bytes)
            offset = 0
            for i, (vaddr, nr, flags) in enumerate(entries):
                if flags & PE_PARENT:
                    raise untrusted(f"{pagemap} has pages in a parent snapshot")
                if not flags & PE_PRESENT:
                    continue
                if lazy_ok and flags & PE_LAZY and i not in made_eager:
                    m.starts.append(vaddr)
                    m.ranges.append((vaddr, nr, offset))
                elif eager and eager[-1][0] + eager[-1][1] == offset:  # one ask for both
                    eager[-1] = (eager[-1][0], eager[-1][1] + nr * PAGE)
                else:
                    eager.append((offset, nr * PAGE))
                offset += nr * PAGE
            # (offset, bytes, written here): first the file's last page (a source whose file
            # is short fails now, before anything is touched), then what CRIU reads itself
            pieces = [(offset - PAGE, PAGE, False)] if offset else []
            pieces += [(part, min(FILL_CHUNK, at + size - part), True)
                       for at, size in eager for part in range(at, at + size, FILL_CHUNK)]
            fd = os.open(pages, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=staging_fd)
            try:
                os.fchown(fd, owner.uid, owner.gid)  # CRIU may read it as the caller
                os.ftruncate(fd, offset)
                for (part, n, write), data in zip(pieces, self._ask_many(pages, pieces), strict=True):
                    if write and os.pwrite(fd, data, part) != n:
                        raise OSError("short write")
            finally:
                os.close(fd)
            if m.ranges:
                self.maps[int(task)] = m
                self.sizes[pages] = offset
            names.add(pages)
            total += offset
        return total

    def _ask_many(self, pages: str, pieces: list[tuple[int, int, bool]]) -> Iterator[memoryview]:
        """The answers to asks for ``pieces`` of ``pages``, in order. Dozens of small ranges
        are usual: they are asked in batches, each sent whole before its answers are read
        (at most ``ASK_BATCH`` asks, a few KiB: the socket takes them while the source
        answers), not one round trip each."""
        for first in range(0, len(pieces), ASK_BATCH):
            batch = pieces[first:first + ASK_BATCH]
            self.sock.sendall(b"".join(ask_bytes(pages, at, n) for at, n, _ in batch))
            for _at, n, _ in batch:
                yield read_exact(self.sock, bytearray(n))

    # -- serving CRIU's page daemon

    def daemon_socket(self) -> socket.socket:
        """The end the daemon gets (``--ps-socket``). The other end and the caller's
        connection go to a process of their own (page_proxy.py), not a thread of the helper's:
        a helper that dies or restarts mid-stream must not end the stream, or the kernel's
        faults would see zero pages once the daemon failed with nobody left to end the tree
        (lazy_pages.py)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        err_r, err_w = os.pipe()
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        maps = {str(pid): [m.pages, m.ranges] for pid, m in self.maps.items()}
        sizes = {m.pages: self.sizes[m.pages] for m in self.maps.values()}
        try:
            self.proxy = subprocess.Popen(
                [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                 "from infinijup_helper.page_proxy import main; main()", here,
                 str(mine.fileno()), str(self.sock.fileno()), str(self.bulk.fileno()),
                 str(err_w)],
                pass_fds=(mine.fileno(), self.sock.fileno(), self.bulk.fileno(), err_w),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, start_new_session=True)
            assert self.proxy.stdin is not None
            self.proxy.stdin.write(json.dumps({"maps": maps, "sizes": sizes}).encode())
            self.proxy.stdin.close()
        except BaseException:
            os.close(err_r)
            theirs.close()
            raise
        finally:
            os.close(err_w)
            mine.close()
            self.sock.close()  # the proxy's now
            self.bulk.close()
        self._err = err_r
        return theirs

    @property
    def error(self) -> str | None:
        """What ended the proxy's stream early, once it has exited (None: nothing)."""
        if self._err is None:
            return self._why
        if self.proxy is not None:
            try:
                self.proxy.wait(timeout=5)  # it writes why, then exits
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        with os.fdopen(self._err, "rb") as f:
            self._err = None
            self._why = f.read(4096).decode(errors="replace").strip() or None
        return self._why

    def close(self) -> None:
        """Stop serving: the daemon's reads end with it."""
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait()
        for sk in (self.sock, self.bulk):
            with contextlib.suppress(OSError):
                sk.close()
