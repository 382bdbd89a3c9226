"""The page proxy (infinijup_helper/page_proxy.py) between a daemon that speaks CRIU's
page-server protocol (played here over a real socket) and a page source: every answer is the
source's bytes; what the daemon has had is let go (the proxy holds no more than its lead), and
a range the daemon asks for again is asked of the source again. The whole path, with CRIU's
daemon and a kernel, is in test_helper_page_source.py."""

from __future__ import annotations

import os
import socket
import struct
import threading

from infinijup_helper.page_proxy import (
    IOV,
    PAGE,
    PS_IOV_CLOSE,
    PS_IOV_GET,
    LazyMap,
    _Proxy,
    read_exact,
)

PAGES = 1024  # 4 MiB: the proxy's stream asks 1 MiB at a time
VADDR = 0x7F0000000000
DST = 4242
NAME = "pages-1.img"


class _Watched(_Proxy):
    """The proxy, noting the bytes it held after each of its stream's asks."""

    most_held = 0

    def _send(self, pages, first, count, line, background=False, once=False):  # noqa: ANN001, ANN202
        ask = super()._send(pages, first, count, line, background, once)
        if background:
            self.most_held = max(self.most_held, self.held_bytes)
        return ask


def _serve(sk: socket.socket, data: bytes, asked: list[tuple[int, int]]) -> None:
    """The source's side of one connection: each ask answered from ``data``."""
    with sk, sk.makefile("rb") as f:
        while head := f.read(4):
            name = f.read(struct.unpack("<I", head)[0]).decode()
            offset, length = struct.unpack("<QQ", f.read(16))
            assert name == NAME
            asked.append((offset, length))
            sk.sendall(data[offset:offset + length])


def _get(daemon: socket.socket, first: int, count: int) -> bytes:
    daemon.sendall(IOV.pack(PS_IOV_GET, count, VADDR + first * PAGE, DST))
    head = bytes(read_exact(daemon, bytearray(IOV.size)))
    _cmd, nr, vaddr, dst = IOV.unpack(head)
    assert (nr, vaddr, dst) == (count, VADDR + first * PAGE, DST)
    return bytes(read_exact(daemon, bytearray(count * PAGE)))


def test_answers_are_the_sources_and_what_was_sent_is_let_go():
    data = os.urandom(PAGES * PAGE)
    ours, theirs = socket.socketpair()
    asked: list[tuple[int, int]] = []
    lines, sources = {}, []
    for line in ("fault", "bulk"):
        proxy_end, source_end = socket.socketpair()
        lines[line] = proxy_end
        sources.append(threading.Thread(target=_serve, args=(source_end, data, asked)))
    proxy = _Watched(theirs, lines, {DST: LazyMap(NAME, [VADDR], [(VADDR, PAGES, 0)])},
                     {NAME: len(data)})
    proxy.LEAD = 1 << 20  # a quarter of the file: the stream waits for the daemon
    runner = threading.Thread(target=proxy.run)
    for t in (*sources, runner):
        t.start()
    try:
        assert _get(ours, 0, 16) == data[:16 * PAGE]
        assert _get(ours, 700, 8) == data[700 * PAGE:708 * PAGE]
        before = len(asked)
        # had already, and let go: the source is asked again, for just that range
        assert _get(ours, 4, 4) == data[4 * PAGE:8 * PAGE]
        assert (4 * PAGE, 4 * PAGE) in asked[before:]
        for first in range(16, PAGES, 64):  # the daemon's own stream, every page left
            count = min(64, PAGES - first)
            assert _get(ours, first, count) == data[first * PAGE:(first + count) * PAGE]
        ours.sendall(IOV.pack(PS_IOV_CLOSE, 0, 0, 0))
        assert struct.unpack("<i", bytes(read_exact(ours, bytearray(4))))[0] == 0
        runner.join(timeout=60)
        assert not runner.is_alive()
        assert proxy.error is None
        assert proxy.held_bytes == 0, "asks the daemon had all of are still held"
        assert 0 < proxy.most_held <= proxy.LEAD + proxy.BACKGROUND_ASK
    finally:
        proxy._end()
        runner.join(timeout=60)
        ours.close()
        for t in sources:
            t.join(timeout=60)


def test_short_runs_of_lazy_pages_are_restored_with_the_process_the_shortest_first():
    from infinijup_helper.page_source import EAGER_RUN, EAGER_TOTAL, eager_entries

    lazy, present, parent = 6, 4, 5  # PE_LAZY | PE_PRESENT; PE_PRESENT; with PE_PARENT
    mib = 256  # pages
    big = EAGER_RUN // 4096
    entries = [
        (0x10000000, 16, lazy), (0x10010000, 16, lazy),  # one run of 128 KiB: two entries
        (0x20000000, big, lazy),  # a run of EAGER_RUN: stays lazy
        (0x30000000, 4, present),  # restored by CRIU anyway: not counted
        (0x40000000, mib, lazy), (0x40000000 + mib * 4096, mib, lazy),  # 2 MiB
        (0x50000000, 8, parent),
        (0x60000000, 8, lazy),
    ]
    assert eager_entries(entries) == {0, 1, 4, 5, 7}
    # runs that together pass EAGER_TOTAL: the shortest are taken until it is reached
    each = (EAGER_RUN // 2) // 4096
    many = [(0x1_0000_0000 * (k + 1), each - k, lazy) for k in range(EAGER_TOTAL // (EAGER_RUN // 2) + 2)]
    chosen = eager_entries(many)
    assert sum(many[i][1] for i in chosen) * 4096 <= EAGER_TOTAL
    assert chosen == set(range(len(many) - len(chosen), len(many)))  # the shortest
    assert eager_entries([(0x1000, 4, lazy), (0x1000 + 4 * 4096, 4, present)]) == {0}
