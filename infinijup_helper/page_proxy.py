"""The process between CRIU's page daemon and the caller's page source (page_source.py).

It speaks CRIU's page-server protocol to the daemon (``lazy-pages --page-server
--ps-socket``) and asks the caller's source for bytes (the wire: page_source.py's docs).
Every request of the daemon is checked against the pagemaps before anything is asked. What
arrives is kept in this process's memory until the daemon has had it, and is then let go: the
lazy ranges of the staged page files stay holes. (Written into them, a stream of many GiB
filled the page cache and then the disk: on the 2-core VM a 3 GiB stream from a store ran at
0.12-0.16 GiB/s, bound by the write-back.) Each page is asked of the source once: a page asked
and not yet here is waited for, not asked again (``_Proxy.claimed``). A page the daemon asks
for a second time, after it had it, is asked of the source again.

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
    stdin (JSON) the lazy ranges and the page files' sizes. Exits when the daemon says it is
    done or either side ends."""
    daemon = socket.socket(fileno=int(sys.argv[2]))
    source = socket.socket(fileno=int(sys.argv[3]))
    bulk = socket.socket(fileno=int(sys.argv[4]))
    err = int(sys.argv[5])
    given = json.loads(sys.stdin.buffer.read())
    maps = {int(pid): LazyMap(pages, [r[0] for r in ranges], [tuple(r) for r in ranges])
            for pid, (pages, ranges) in given["maps"].items()}
    proxy = _Proxy(daemon, {"fault": source, "bulk": bulk}, maps, given["sizes"])
    proxy.run()
    if proxy.error:
        os.write(err, proxy.error.encode()[:4096])
    os._exit(0)


class _Ask:
    """A range of pages asked of the source; ``done`` once its bytes are here (``data``) or
    it failed. They are kept until the daemon has had every page of it (``left``). A ``once``
    ask brings a range the daemon asks for again: only that answer uses it."""

    def __init__(self, pages: str, first: int, count: int, background: bool,
                 once: bool = False) -> None:
        self.pages, self.first, self.count = pages, first, count
        self.background, self.once = background, once
        self.left = count
        self.data: bytearray | None = None
        self.done = threading.Event()


class _Held:
    """One page file's asks not yet all sent to the daemon, by first page (they never
    overlap: each page is claimed by one ask)."""

    def __init__(self) -> None:
        self.firsts: list[int] = []
        self.asks: list[_Ask] = []

    def add(self, ask: _Ask) -> None:
        i = bisect.bisect_left(self.firsts, ask.first)
        self.firsts.insert(i, ask.first)
        self.asks.insert(i, ask)

    def remove(self, ask: _Ask) -> None:
        i = bisect.bisect_left(self.firsts, ask.first)
        assert self.asks[i] is ask
        del self.firsts[i], self.asks[i]

    def over(self, lo: int, hi: int) -> list[_Ask]:
        """The asks holding pages of [lo, hi), in order."""
        i = max(0, bisect.bisect_right(self.firsts, lo) - 1)
        out = []
        while i < len(self.asks) and self.firsts[i] < hi:
            if self.asks[i].first + self.asks[i].count > lo:
                out.append(self.asks[i])
            i += 1
        return out


class _Proxy:
    """Between the page daemon and the caller's source. Besides the daemon's own requests,
    ``background`` streams every lazy range from the source in asks of 1 MiB, four in flight
    (and at most ``LEAD`` bytes held ahead of the daemon): the daemon asks one range at a time
    and waits for it, which over two processes' round trips would set the pace. A fault (a
    request of a few pages) is asked on a second connection, with its aligned neighbours, so
    it never waits behind the stream's asks (only behind the daemon's own request before it,
    whose answer goes back first: the daemon's answers go back in the order it asked, as its
    page-server protocol requires)."""

    # Enough in flight to keep the source busy; the source decodes an ask of 1 MiB or more
    # on its threads (engine/store_pages.py).
    BACKGROUND_ASK = 1 << 20
    IN_FLIGHT = 4
    # The stream's bytes held here before the daemon asks for them, at most (more is not
    # asked until the daemon has taken some): this process's memory, not the kernel's.
    LEAD = 32 << 20
    # A page not here yet is fetched with its neighbours (aligned, within its file): the
    # kernel's next faults are mostly near its last, and are then answered from here.
    AROUND = 256 << 10

    def __init__(self, daemon: socket.socket, lines: dict[str, socket.socket],
                 maps: dict[int, LazyMap], sizes: dict[str, int]) -> None:
        self.daemon, self.lines, self.maps = daemon, lines, maps
        # per page: claimed (asked of the source, or not lazy: never asked) and gone (sent
        # to the daemon); per file, the asks whose bytes are here or coming, until the
        # daemon has had all of them
        self.claimed = {name: bytearray(b"\1" * (size // PAGE)) for name, size in sizes.items()}
        for m in maps.values():
            for _vaddr, count, offset in m.ranges:
                self.claimed[m.pages][offset // PAGE:offset // PAGE + count] = bytes(count)
        self.gone = {name: bytearray(len(bits)) for name, bits in self.claimed.items()}
        self.held = {name: _Held() for name in sizes}
        self.held_bytes = 0
        # buffers of the stream's size let go, filled again (not allocated and zeroed anew);
        # at most as many as the lead holds
        self.spare: list[bytearray] = []
        # each line's asks, in the order sent
        self.asked: dict[str, queue.Queue[_Ask | None]] = {k: queue.Queue() for k in lines}
        self.answers: queue.Queue[tuple | None] = queue.Queue()  # the daemon's, in order
        self.lock = threading.Lock()  # the bitmaps, the held asks, sending an ask
        self.room = threading.Condition(self.lock)  # held_bytes went down, or the end
        self.slots = threading.Semaphore(self.IN_FLIGHT)
        self.ended = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        """Serve until the daemon is done or either side ends (``error``: why, if early)."""
        threads = [threading.Thread(target=t) for t in
                   (self.requests, self.replies, self.background)]
        threads += [threading.Thread(target=self.fetched, args=(line,)) for line in self.lines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _send(self, pages: str, first: int, count: int, line: str,
              background: bool = False, once: bool = False) -> _Ask:
        """Ask for pages [first, +count), all of them unclaimed unless ``once`` (the lock
        held)."""
        if self.ended.is_set():
            raise OSError("the stream ended")
        ask = _Ask(pages, first, count, background, once)
        try:
            send_ask(self.lines[line], pages, first * PAGE, count * PAGE)
        except OSError as exc:
            raise SourceGone(f"the source stopped answering ({exc.strerror or exc})") from None
        self.asked[line].put(ask)
        if not once:
            self.claimed[pages][first:first + count] = b"\1" * count
            self.held[pages].add(ask)
            self.held_bytes += count * PAGE
        return ask

    def _cover(self, pages: str, want: tuple[int, int], fetch: tuple[int, int],
               line: str) -> list[_Ask]:
        """The asks whose bytes make up pages ``want`` [lo, hi): those held over it, and new
        ones, on ``line``, for what of ``fetch`` (which holds ``want``) nobody asked. Pages
        sent to the daemon before: one ask of ``want``, for this answer alone."""
        lo, hi = want
        claimed = self.claimed[pages]
        with self.lock:
            if self.gone[pages].find(1, lo, hi) >= 0:
                return [self._send(pages, lo, hi - lo, "fault", once=True)]
            at, end = fetch
            while (at := claimed.find(0, at, end)) >= 0:
                stop = claimed.find(1, at, end)
                stop = end if stop < 0 else stop
                self._send(pages, at, stop - at, line)
                at = stop
            return self.held[pages].over(lo, hi)

    def requests(self) -> None:
        """The daemon's requests: checked, answered from what is held or asked for."""
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
                lo = offset // PAGE
                want = (lo, lo + count)
                if count * PAGE >= self.AROUND:  # the daemon's own stream: with ours
                    waits = self._cover(m.pages, want, want, "bulk")
                else:  # a fault: on its own line, with its neighbours
                    around = self.AROUND // PAGE
                    fetch = (lo - lo % around,
                             min(len(self.claimed[m.pages]), -(-(lo + count) // around) * around))
                    waits = self._cover(m.pages, want, fetch, "fault")
                self.answers.put((reply, m.pages, want, waits))
        except SourceGone as exc:
            self._fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure ends the stream, with its reason
            self._fail(f"the page daemon's request: {exc}")
        finally:
            self.answers.put(None)

    def fetched(self, line: str) -> None:
        """A line's answers, in the order asked, held until the daemon has them."""
        ask = None
        try:
            while (ask := self.asked[line].get()) is not None:
                size = ask.count * PAGE
                with self.lock:
                    data = self.spare.pop() if size == self.BACKGROUND_ASK and self.spare \
                        else None
                data = bytearray(size) if data is None else data
                read_exact(self.lines[line], data)
                with self.lock:
                    ask.data = data
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
                reply, pages, (lo, hi), waits = item
                while True:  # only this thread lets pages go, so what it finds here stays
                    for ask in waits:
                        ask.done.wait()
                    if self.error is not None or self.ended.is_set():
                        return
                    if waits and waits[0].once:
                        parts = [(waits[0], lo, hi)]
                        break
                    with self.lock:
                        if self.gone[pages].find(1, lo, hi) < 0:
                            parts = [(a, max(lo, a.first), min(hi, a.first + a.count))
                                     for a in self.held[pages].over(lo, hi)]
                            break
                    # an earlier answer had some of it (the daemon asked twice): ask again
                    waits = self._cover(pages, (lo, hi), (lo, hi), "fault")
                self.daemon.sendall(reply)
                for ask, a, b in parts:
                    assert ask.data is not None
                    self.daemon.sendall(memoryview(ask.data)[(a - ask.first) * PAGE:
                                                             (b - ask.first) * PAGE])
                self._sent(pages, lo, hi)
        except OSError as exc:
            self._fail(f"serving the page daemon: {exc.strerror or exc}")
        finally:
            self._end()

    def _sent(self, pages: str, lo: int, hi: int) -> None:
        """Pages [lo, hi) the daemon has: marked so, and an ask it has had all of let go."""
        gone = self.gone[pages]
        with self.lock:
            for ask in self.held[pages].over(lo, hi):
                a, b = max(lo, ask.first), min(hi, ask.first + ask.count)
                ask.left -= gone.count(0, a, b)
                gone[a:b] = b"\1" * (b - a)
                if ask.left == 0:
                    self.held[pages].remove(ask)
                    if ask.data is not None and len(ask.data) == self.BACKGROUND_ASK:
                        self.spare.append(ask.data)  # sent, so free to be filled again
                    ask.data = None
                    self.held_bytes -= ask.count * PAGE
                    self.room.notify_all()

    def background(self) -> None:
        """Every lazy range, in large asks, several in flight, skipping what is claimed."""
        step = self.BACKGROUND_ASK // PAGE
        try:
            for m in sorted(self.maps.values(), key=lambda m: m.pages):
                claimed = self.claimed[m.pages]
                for _vaddr, count, offset in m.ranges:
                    at, end = offset // PAGE, offset // PAGE + count
                    while not self.ended.is_set():
                        self.slots.acquire()
                        with self.lock:
                            while self.held_bytes >= self.LEAD and not self.ended.is_set():
                                self.room.wait()
                            at = claimed.find(0, at, end)
                            if at < 0:
                                self.slots.release()
                                break
                            stop = claimed.find(1, at, min(end, at + step))
                            stop = min(end, at + step) if stop < 0 else stop
                            self._send(m.pages, at, stop - at, "bulk", background=True)
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
            self.room.notify_all()
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


def ask_bytes(pages: str, offset: int, length: int) -> bytes:
    name = pages.encode()
    return struct.pack("<I", len(name)) + name + ASK.pack(offset, length)


def send_ask(sk: socket.socket, pages: str, offset: int, length: int) -> None:
    sk.sendall(ask_bytes(pages, offset, length))


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
