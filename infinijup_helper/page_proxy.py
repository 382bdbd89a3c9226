"""The process between CRIU's page daemon and the caller's page source (page_source.py).

It speaks CRIU's page-server protocol to the daemon (``lazy-pages --page-server
--ps-socket``) and asks the caller's source for bytes (the wire: page_source.py's docs).
Every request of the daemon is checked against the pagemaps before anything is asked. What
arrives is written into the staged page files (their holes), so a range wanted again is read
from there. Each page is asked of the source once: a page asked and not yet here is waited
for, not asked again (``_Proxy.claimed``).

It runs as a process of its own (``main``, started by page_source.py), so a helper that dies
or restarts mid-stream does not end the stream.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import queue
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field

from .criu import PE_PRESENT
from .protocol import RequestError

PAGE = 4096
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
IOV = struct.Struct("<I4xQQQ")  # CRIU's struct page_server_iov: cmd, nr_pages, vaddr, dst_id
ASK = struct.Struct("<QQ")  # after the name: offset, length
MAX_ASK = 64 << 20  # one daemon request's bytes at most (it asks for far less)


class SourceGone(OSError):
    """Asking the source failed: it closed or died."""


def untrusted(msg: str) -> RequestError:
    return RequestError("bad_request", f"page source: {msg}")


@dataclass
class LazyMap:
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


def main() -> None:
    """The proxy process: ``argv``: the daemon's socket, the caller's two, an error pipe; on
    stdin (JSON) the lazy ranges and the staged page files' descriptors. Exits when the
    daemon says it is done or either side ends."""
    daemon = socket.socket(fileno=int(sys.argv[2]))
    source = socket.socket(fileno=int(sys.argv[3]))
    bulk = socket.socket(fileno=int(sys.argv[4]))
    err = int(sys.argv[5])
    given = json.loads(sys.stdin.buffer.read())
    maps = {int(pid): LazyMap(pages, [r[0] for r in ranges], [tuple(r) for r in ranges])
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

    def __init__(self, pages: str, offset: int, length: int, background: bool) -> None:
        self.pages, self.offset, self.length = pages, offset, length
        self.background = background
        self.done = threading.Event()

    def overlaps(self, offset: int, length: int) -> bool:
        return self.offset < offset + length and offset < self.offset + self.length


class _Proxy:
    """Between the page daemon and the caller's source. Besides the daemon's own requests,
    ``background`` streams every lazy range from the source in asks of 1 MiB, four in flight:
    the daemon asks one range at a time and waits for it, which over two processes' round
    trips would set the pace. A fault (a request of a few pages) is asked on a second
    connection, with its aligned neighbours, so it never waits behind the stream's asks
    (only behind the daemon's own request before it, whose answer goes back first: the
    daemon's answers go back in the order it asked, as its page-server protocol requires)."""

    # Enough in flight to keep the source busy; the source decodes an ask of 1 MiB or more
    # on its threads (engine/store_pages.py).
    BACKGROUND_ASK = 1 << 20
    IN_FLIGHT = 4
    # A page not here yet is fetched with its neighbours (aligned, within its file): the
    # kernel's next faults are mostly near its last, and are then answered from here.
    AROUND = 256 << 10

    def __init__(self, daemon: socket.socket, lines: dict[str, socket.socket],
                 maps: dict[int, LazyMap], files: dict[str, int]) -> None:
        self.daemon, self.lines, self.maps, self.files = daemon, lines, maps, files
        # per page: here (written into the staged file; all but the lazy ranges were filled
        # in before the restore, page_source.py)
        self.present = {name: bytearray(b"\1" * (os.fstat(fd).st_size // PAGE))
                        for name, fd in files.items()}
        for m in maps.values():
            for _vaddr, count, offset in m.ranges:
                self.present[m.pages][offset // PAGE:offset // PAGE + count] = bytes(count)
        # per page: asked of the source or here; and the asks not answered yet
        self.claimed = {name: bytearray(bits) for name, bits in self.present.items()}
        self.pending: dict[str, list[_Ask]] = {name: [] for name in files}
        # each line's asks, in the order sent
        self.asked: dict[str, queue.Queue[_Ask | None]] = {k: queue.Queue() for k in lines}
        self.answers: queue.Queue[tuple | None] = queue.Queue()  # the daemon's, in order
        self.lock = threading.Lock()  # the bitmaps, the pending asks, sending an ask
        self.slots = threading.Semaphore(self.IN_FLIGHT)
        self.ended = threading.Event()
        self.error: str | None = None

    def _send(self, pages: str, offset: int, length: int, line: str,
              background: bool = False) -> _Ask:
        """Ask for [offset, +length), all of it unclaimed (the lock held)."""
        if self.ended.is_set():
            raise OSError("the stream ended")
        ask = _Ask(pages, offset, length, background)
        try:
            send_ask(self.lines[line], pages, offset, length)
        except OSError as exc:
            raise SourceGone(f"the source stopped answering ({exc.strerror or exc})") from None
        self.asked[line].put(ask)
        first = offset // PAGE
        self.claimed[pages][first:first + length // PAGE] = b"\1" * (length // PAGE)
        self.pending[pages].append(ask)
        return ask

    def _cover(self, pages: str, want: tuple[int, int], fetch: tuple[int, int],
               line: str) -> list[_Ask]:
        """The asks that bring ``want`` (offset, length) here: those already pending over it,
        and new ones, on ``line``, for what of ``fetch`` (which holds ``want``) nobody asked."""
        claimed = self.claimed[pages]
        with self.lock:
            waits = [a for a in self.pending[pages] if a.overlaps(*want)]
            at, end = fetch[0] // PAGE, (fetch[0] + fetch[1]) // PAGE
            while (at := claimed.find(0, at, end)) >= 0:
                stop = claimed.find(1, at, end)
                stop = end if stop < 0 else stop
                ask = self._send(pages, at * PAGE, (stop - at) * PAGE, line)
                if ask.overlaps(*want):
                    waits.append(ask)
                at = stop
        return waits

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
                waits: list[_Ask] = []
                if self._have(m.pages, offset, length):
                    pass
                elif length >= self.AROUND:  # the daemon's own stream: with ours
                    waits = self._cover(m.pages, (offset, length), (offset, length), "bulk")
                else:  # a fault: on its own line, with its neighbours
                    size = len(self.present[m.pages]) * PAGE
                    start = offset - offset % self.AROUND
                    stop = min(size, -(-(offset + length) // self.AROUND) * self.AROUND)
                    waits = self._cover(m.pages, (offset, length), (start, stop - start),
                                        "fault")
                self.answers.put((reply, m.pages, offset, length, waits))
        except SourceGone as exc:
            self._fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure ends the stream, with its reason
            self._fail(f"the page daemon's request: {exc}")
        finally:
            self.answers.put(None)

    def fetched(self, line: str) -> None:
        """A line's answers, in the order asked, written into the staged files."""
        ask, buf = None, bytearray()
        try:
            while (ask := self.asked[line].get()) is not None:
                if len(buf) < ask.length:
                    buf = bytearray(ask.length)
                view, at = read_exact(self.lines[line], memoryview(buf)[:ask.length]), ask.offset
                while view:
                    n = os.pwrite(self.files[ask.pages], view, at)
                    view, at = view[n:], at + n
                first = ask.offset // PAGE
                with self.lock:
                    self.present[ask.pages][first:first + ask.length // PAGE] = \
                        b"\1" * (ask.length // PAGE)
                    self.pending[ask.pages].remove(ask)
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
                reply, pages, offset, length, waits = item
                for ask in waits:
                    ask.done.wait()
                if self.error is not None:
                    return
                self.daemon.sendall(reply)
                while length:  # from the page cache, not through this process's memory
                    sent = os.sendfile(self.daemon.fileno(), self.files[pages], offset, length)
                    if sent == 0:
                        raise OSError("short read of a staged page file")
                    offset, length = offset + sent, length - sent
        except OSError as exc:
            self._fail(f"serving the page daemon: {exc.strerror or exc}")
        finally:
            self._end()

    def background(self) -> None:
        """Every lazy range, in large asks, several in flight, skipping what is claimed."""
        try:
            for m in sorted(self.maps.values(), key=lambda m: m.pages):
                claimed = self.claimed[m.pages]
                for _vaddr, count, offset in m.ranges:
                    at, end = offset // PAGE, offset // PAGE + count
                    while not self.ended.is_set():
                        self.slots.acquire()
                        with self.lock:
                            at = claimed.find(0, at, end)
                            if at < 0:
                                self.slots.release()
                                break
                            stop = claimed.find(1, at, min(end, at + self.BACKGROUND_ASK // PAGE))
                            stop = min(end, at + self.BACKGROUND_ASK // PAGE) if stop < 0 else stop
                            self._send(m.pages, at * PAGE, (stop - at) * PAGE, "bulk",
                                       background=True)
                        at = stop
        except OSError:
            pass  # the stream ended; whoever ended it says why

    def _fail(self, why: str) -> None:
        if self.error is None and not self.ended.is_set():
            self.error = why
        self._end()

    def _end(self) -> None:
        """Stop everything: the sockets shut, every wait released."""
        with self.lock:
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


def send_ask(sk: socket.socket, pages: str, offset: int, length: int) -> None:
    name = pages.encode()
    sk.sendall(struct.pack("<I", len(name)) + name + ASK.pack(offset, length))


def read_exact(sk: socket.socket, into: bytearray | memoryview) -> memoryview:
    """``into`` filled from ``sk`` (a view of it)."""
    view, got, length = memoryview(into), 0, len(into)
    while got < length:
        n = sk.recv_into(view[got:])
        if n == 0:
            raise untrusted(f"the source closed after {got} of {length} bytes")
        got += n
    return view


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
