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
  own (``main``), so that the stream outlives a helper that dies or restarts.

Wire to the source, per range: ``u32`` name length, the page file's name (``pages-N.img``),
``u64`` offset, ``u64`` length; the answer is those bytes, in the order asked. The helper
connects twice: faults on one connection, the background stream on the other (``_Proxy``).
A short answer, a closed connection or a wrong name ends the stream: the daemon fails, the
tree is ended (lazy_pages.py), the reason recorded.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import queue
import socket
import stat
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from .criu import PE_PARENT, PE_PRESENT, image_names
from .proc import Caller
from .protocol import RequestError

PAGE = 4096
PE_LAZY = 2
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
IOV = struct.Struct("<I4xQQQ")  # CRIU's struct page_server_iov: cmd, nr_pages, vaddr, dst_id
ASK = struct.Struct("<QQ")  # after the name: offset, length
FILL_CHUNK = 8 << 20
MAX_ASK = 64 << 20  # one daemon request's bytes at most (it asks for far less)


def _connect(images_fd: int, name: str, caller: Caller) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{images_fd}/{name}")
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != caller.uid:
            raise _untrusted(f"{name} is served by uid {uid}, not by the caller")
    except OSError as exc:
        sock.close()
        raise _untrusted(f"cannot connect to {name}: {exc.strerror}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _untrusted(msg: str) -> RequestError:
    return RequestError("bad_request", f"page source: {msg}")


@dataclass
class _Map:
    """One task's lazy ranges: sorted starts, and (vaddr, pages, offset in its page file)."""

    pages: str
    starts: list[int] = field(default_factory=list)
    ranges: list[tuple[int, int, int]] = field(default_factory=list)

    def find(self, vaddr: int, nr: int) -> tuple[int, int]:
        """(offset, pages) of the part of [vaddr, +nr pages) inside one lazy range."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i < 0:
            raise ValueError(f"address {vaddr:#x} is in no lazy range")
        start, count, offset = self.ranges[i]
        if vaddr % PAGE or vaddr >= start + count * PAGE:
            raise ValueError(f"address {vaddr:#x} is in no lazy range")
        skip = (vaddr - start) // PAGE
        return offset + skip * PAGE, min(nr, count - skip)


class PageSource:
    """The caller's connection, the staged page files and the daemon's lazy ranges."""

    def __init__(self, images_fd: int, name: str, caller: Caller) -> None:
        if not name or "/" in name or len(name) > 64 or name in (".", ".."):
            raise _untrusted(f"bad socket name {name!r}")
        try:
            st = os.stat(name, dir_fd=images_fd, follow_symlinks=False)
        except OSError as exc:
            raise _untrusted(f"{name}: {exc.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise _untrusted(f"{name} is not a socket")
        # two connections: faults, and the stream (so a fault never waits behind it)
        self.sock = _connect(images_fd, name, caller)
        try:
            self.bulk = _connect(images_fd, name, caller)
        except BaseException:
            self.sock.close()
            raise
        self.maps: dict[int, _Map] = {}
        self.proxy: subprocess.Popen | None = None
        self._err: int | None = None
        self._why: str | None = None
        self._staging_fd = -1

    # -- the staged page files

    def fill(self, criu: Any, staging_fd: int, owner: Caller, *, everything: bool) -> int:
        """Make each page file the pagemaps name (sparse, full size) in the staging dir and
        fill what the restore reads itself (``everything``: all of it); bytes made."""
        total = 0
        self._staging_fd = staging_fd
        names = set(image_names(staging_fd))
        for pagemap in sorted(n for n in names if n.startswith("pagemap") and n.endswith(".img")):
            pages_id, entries = criu.pagemap_entries(staging_fd, pagemap)
            pages = f"pages-{pages_id}.img"
            if pages in names:
                raise _untrusted(f"{pages} came with the images and from the source")
            task = pagemap.removeprefix("pagemap-").removesuffix(".img")
            lazy_ok = task.isdigit() and not everything
            m = _Map(pages)
            eager: list[tuple[int, int]] = []  # (offset, bytes)
            offset = 0
            for vaddr, nr, flags in entries:
                if flags & PE_PARENT:
                    raise _untrusted(f"{pagemap} has pages in a parent snapshot")
                if not flags & PE_PRESENT:
                    continue
                if lazy_ok and flags & PE_LAZY:
                    m.starts.append(vaddr)
                    m.ranges.append((vaddr, nr, offset))
                else:
                    eager.append((offset, nr * PAGE))
                offset += nr * PAGE
            if offset:  # a source whose file is short fails now, before anything is touched
                self._ask(pages, offset - PAGE, PAGE)
            fd = os.open(pages, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=staging_fd)
            try:
                os.fchown(fd, owner.uid, owner.gid)  # CRIU may read it as the caller
                os.ftruncate(fd, offset)
                for at, size in eager:
                    for part in range(at, at + size, FILL_CHUNK):
                        n = min(FILL_CHUNK, at + size - part)
                        data = self._ask(pages, part, n)
                        if os.pwrite(fd, data, part) != n:
                            raise OSError("short write")
            finally:
                os.close(fd)
            if m.ranges:
                self.maps[int(task)] = m
            names.add(pages)
            total += offset
        return total

    def _ask(self, pages: str, offset: int, length: int) -> bytearray:
        _send_ask(self.sock, pages, offset, length)
        return _read_exact(self.sock, length)

    # -- serving CRIU's page daemon

    def daemon_socket(self) -> socket.socket:
        """The end the daemon gets (``--ps-socket``). The other end and the caller's
        connection go to a process of their own (``main``), not a thread of the helper's:
        a helper that dies or restarts mid-stream must not end the stream, or the kernel's
        faults would see zero pages once the daemon failed with nobody left to end the tree
        (lazy_pages.py)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        err_r, err_w = os.pipe()
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        maps = {str(pid): [m.pages, m.ranges] for pid, m in self.maps.items()}
        files = {m.pages: os.open(m.pages, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  dir_fd=self._staging_fd) for m in self.maps.values()}
        try:
            self.proxy = subprocess.Popen(
                [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                 "from infinijup_helper.page_source import main; main()", here,
                 str(mine.fileno()), str(self.sock.fileno()), str(self.bulk.fileno()),
                 str(err_w)],
                pass_fds=(mine.fileno(), self.sock.fileno(), self.bulk.fileno(), err_w,
                          *files.values()),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, start_new_session=True)
            assert self.proxy.stdin is not None
            self.proxy.stdin.write(json.dumps({"maps": maps, "files": files}).encode())
            self.proxy.stdin.close()
        except BaseException:
            os.close(err_r)
            theirs.close()
            raise
        finally:
            os.close(err_w)
            for fd in files.values():
                os.close(fd)
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


def main() -> None:
    """The proxy process: ``argv``: the daemon's socket, the caller's, an error pipe; on
    stdin (JSON) the lazy ranges and the staged page files' descriptors. Exits when the
    daemon says it is done or either side ends."""
    daemon = socket.socket(fileno=int(sys.argv[2]))
    source = socket.socket(fileno=int(sys.argv[3]))
    bulk = socket.socket(fileno=int(sys.argv[4]))
    err = int(sys.argv[5])
    given = json.loads(sys.stdin.buffer.read())
    maps = {int(pid): _Map(pages, [r[0] for r in ranges], [tuple(r) for r in ranges])
            for pid, (pages, ranges) in given["maps"].items()}
    proxy = _Proxy(daemon, {"fault": source, "bulk": bulk}, maps, given["files"])
    threads = [threading.Thread(target=t) for t in
               (proxy.requests, proxy.replies, proxy.background)]
    threads += [threading.Thread(target=proxy.fetched, args=(line,)) for line in ("fault", "bulk")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if proxy.error:
        os.write(err, proxy.error.encode()[:4096])
    os._exit(0)


class _Ask:
    """A range asked of the source; ``done`` once it is in the staged file (or failed)."""

    def __init__(self, pages: str, offset: int, length: int, line: str,
                 background: bool) -> None:
        self.pages, self.offset, self.length = pages, offset, length
        self.line = line
        self.background = background
        self.done = threading.Event()


class _Proxy:
    """Between the page daemon and the caller's source. Whatever arrives is written into the
    staged page file (its holes), so a range asked again (a fault where the stream has been)
    is answered from there. Besides the daemon's own requests, ``background`` streams every
    lazy range from the source in asks of 256 KiB, two in flight: the daemon asks one range at
    a time and waits for it, which over two processes' round trips would set the pace. A fault
    (a request of a few pages) is asked on a second connection, with its aligned neighbours, so
    it never waits behind the stream. The daemon's answers go back in the order it asked, as
    its page-server protocol requires."""

    # Enough in flight to keep the source busy.
    BACKGROUND_ASK = 256 << 10
    IN_FLIGHT = 2
    # A page not here yet is fetched with its neighbours (aligned, within its file): the
    # kernel's next faults are mostly near its last, and are then answered from here.
    AROUND = 256 << 10

    def __init__(self, daemon: socket.socket, lines: dict[str, socket.socket],
                 maps: dict[int, _Map], files: dict[str, int]) -> None:
        self.daemon, self.lines, self.maps, self.files = daemon, lines, maps, files
        self.present = {name: bytearray(os.fstat(fd).st_size // PAGE)
                        for name, fd in files.items()}
        # each line's asks, in the order sent
        self.asked: dict[str, queue.Queue[_Ask | None]] = {k: queue.Queue() for k in lines}
        self.answers: queue.Queue[tuple | None] = queue.Queue()  # the daemon's, in order
        self.send_lock = threading.Lock()
        self.slots = threading.Semaphore(self.IN_FLIGHT)
        self.ended = threading.Event()
        self.error: str | None = None

    def _ask(self, pages: str, offset: int, length: int, line: str,
             background: bool = False) -> _Ask:
        ask = _Ask(pages, offset, length, line, background)
        with self.send_lock:
            if self.ended.is_set():
                raise OSError("the stream ended")
            _send_ask(self.lines[line], pages, offset, length)
            self.asked[line].put(ask)
        return ask

    def _have(self, pages: str, offset: int, length: int) -> bool:
        bitmap = self.present[pages]
        return bitmap.find(0, offset // PAGE, (offset + length) // PAGE) < 0

    def requests(self) -> None:
        """The daemon's requests: checked, answered from the staged file or asked for."""
        try:
            while True:
                head = _recv_all(self.daemon, IOV.size)
                if head is None:
                    return
                cmd, nr, vaddr, dst = IOV.unpack(head)
                if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                    self.answers.put(("close",))
                    return
                if cmd != PS_IOV_GET or nr <= 0 or nr * PAGE > MAX_ASK or dst not in self.maps:
                    raise ValueError(f"unexpected request {cmd:#x} for {dst} ({nr} pages)")
                m = self.maps[dst]
                offset, count = m.find(vaddr, nr)
                reply = IOV.pack(PS_IOV_ADD_F | (PE_PRESENT << PS_CMD_BITS), count, vaddr, dst)
                length = count * PAGE
                ask = None
                if self._have(m.pages, offset, length):
                    pass
                elif length >= self.AROUND:  # the daemon's own stream: with ours
                    ask = self._ask(m.pages, offset, length, "bulk")
                else:  # a fault: on its own line, with its neighbours
                    size = len(self.present[m.pages]) * PAGE
                    start = offset - offset % self.AROUND
                    stop = min(size, -(-(offset + length) // self.AROUND) * self.AROUND)
                    ask = self._ask(m.pages, start, stop - start, "fault")
                self.answers.put((reply, m.pages, offset, length, ask))
        except Exception as exc:  # noqa: BLE001 - any failure ends the stream, with its reason
            self._fail(f"the page daemon's request: {exc}")
        finally:
            self.answers.put(None)

    def fetched(self, line: str) -> None:
        """A line's answers, in the order asked, written into the staged files."""
        ask = None
        try:
            while (ask := self.asked[line].get()) is not None:
                data = _read_exact(self.lines[line], ask.length)
                view, at = memoryview(data), ask.offset
                while view:
                    n = os.pwrite(self.files[ask.pages], view, at)
                    view, at = view[n:], at + n
                first = ask.offset // PAGE
                self.present[ask.pages][first:first + ask.length // PAGE] = \
                    b"\1" * (ask.length // PAGE)
                ask.done.set()
                if ask.background:
                    self.slots.release()
        except RequestError as exc:
            self._fail(f"the source stopped answering ({exc.message})")
        except OSError as exc:
            self._fail(f"the source stopped answering ({exc.strerror or exc})")
        finally:
            if ask is not None:  # the one being read when it failed: let its waiter go
                ask.done.set()

    def replies(self) -> None:
        """The daemon's answers, in the order it asked."""
        try:
            while (item := self.answers.get()) is not None:
                if item[0] == "close":
                    self.daemon.sendall(struct.pack("<i", 0))
                    return
                reply, pages, offset, length, ask = item
                if ask is not None:
                    ask.done.wait()
                if self.error is not None:
                    return
                data = os.pread(self.files[pages], length, offset)
                if len(data) != length:
                    raise OSError("short read of a staged page file")
                self.daemon.sendall(reply)
                self.daemon.sendall(data)
        except OSError as exc:
            self._fail(f"serving the page daemon: {exc.strerror or exc}")
        finally:
            self._end()

    def background(self) -> None:
        """Every lazy range, in large asks, several in flight, skipping what is here."""
        try:
            for m in sorted(self.maps.values(), key=lambda m: m.pages):
                for _vaddr, count, offset in m.ranges:
                    end = offset + count * PAGE
                    while offset < end and not self.ended.is_set():
                        length = min(self.BACKGROUND_ASK, end - offset)
                        if not self._have(m.pages, offset, length):
                            self.slots.acquire()
                            self._ask(m.pages, offset, length, "bulk", background=True)
                        offset += length
        except OSError:
            pass  # the stream ended; whoever ended it says why

    def _fail(self, why: str) -> None:
        if self.error is None and not self.ended.is_set():
            self.error = why
        self._end()

    def _end(self) -> None:
        """Stop everything: the sockets shut, every wait released."""
        with self.send_lock:
            self.ended.set()
            for asked in self.asked.values():
                asked.put(None)
        self.answers.put(None)
        for _ in range(self.IN_FLIGHT):
            self.slots.release()
        for sk in (self.daemon, *self.lines.values()):
            with contextlib.suppress(OSError):
                sk.shutdown(socket.SHUT_RDWR)
        for asked in self.asked.values():
            while True:  # asks that will never be answered: let their waiters go
                try:
                    pending = asked.get_nowait()
                except queue.Empty:
                    break
                if pending is not None:
                    pending.done.set()
            asked.put(None)


def _send_ask(sk: socket.socket, pages: str, offset: int, length: int) -> None:
    name = pages.encode()
    sk.sendall(struct.pack("<I", len(name)) + name + ASK.pack(offset, length))


def _read_exact(sk: socket.socket, length: int) -> bytearray:
    buf = bytearray(length)
    view, got = memoryview(buf), 0
    while got < length:
        n = sk.recv_into(view[got:])
        if n == 0:
            raise _untrusted(f"the source closed after {got} of {length} bytes")
        got += n
    return buf


def _recv_all(sk: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at a clean end before the first."""
    data = b""
    while len(data) < n:
        part = sk.recv(n - len(data))
        if not part:
            if data:
                raise ValueError("the page daemon's request was cut short")
            return None
        data += part
    return data
