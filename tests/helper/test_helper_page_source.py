"""Restores whose page files are served by the caller over a socket (page_source.py): the
kernel answers, every page arrives from the source and nothing else, a source that stops
mid-stream ends the kernel with the reason, and a socket served by another account or bad
requests are refused before any kernel is touched."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import threading
from pathlib import Path

import pytest
from helperkit import Kernel, needs_root_and_criu

from infinijup.errors import InfinijupError

pytestmark = needs_root_and_criu

MIB = 256
FILL = (f"import os, hashlib\nblob = bytearray(os.urandom({MIB} << 20))\n"
        "digest = hashlib.blake2b(blob).hexdigest()")
CHECK = "hashlib.blake2b(blob).hexdigest() == digest"


class FileSource:
    """Serves page files from a directory, as the server serves them from its store (on the
    helper's two connections: faults, and the stream); after ``stop_after`` bytes it closes
    the connections (``stopped`` is set then)."""

    def __init__(self, where: Path, files: Path, stop_after: int | None = None,
                 stream_held: bool = False) -> None:
        self.files = files
        self.stop_after = stop_after
        self.hold_after: int | None = None  # after this many bytes, wait for ``go``
        self.holding = threading.Event()
        self.go = threading.Event()
        # the second connection (the helper's stream) waits for this before each ask
        self.stream_go = threading.Event()
        if not stream_held:
            self.stream_go.set()
        self.served = 0
        self.asked: list[tuple[str, int, int]] = []
        self.asked_for_faults = 0  # asks on the first connection (faults, the restore's fill)
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(where))
        self.listener.listen(2)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        workers = []
        for _ in range(2):
            try:
                conn, _ = self.listener.accept()
            except OSError:
                break
            self.conns.append(conn)
            workers.append(threading.Thread(target=self._serve, args=(conn, len(workers) == 1),
                                            daemon=True))
            workers[-1].start()
        for w in workers:
            w.join()

    def _serve(self, conn: socket.socket, stream: bool) -> None:
        with conn:
            f = conn.makefile("rb")
            while head := f.read(4):
                name = f.read(struct.unpack("<I", head)[0]).decode()
                offset, length = struct.unpack("<QQ", f.read(16))
                if stream:
                    self.stream_go.wait()
                with self.lock:
                    self.asked.append((name, offset, length))
                    self.asked_for_faults += not stream
                    stop = self.stop_after is not None and self.served + length > self.stop_after
                if stop:
                    self.stopped.set()
                    for other in self.conns:
                        other.shutdown(socket.SHUT_RDWR)
                    return
                if self.hold_after is not None and self.served + length > self.hold_after:
                    self.holding.set()
                    self.go.wait()
                with open(self.files / name, "rb") as src:
                    conn.sendall(os.pread(src.fileno(), length, offset))
                with self.lock:
                    self.served += length

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=60)


def _dump_without_pages(client, kernel: Kernel, tmp_path: Path) -> tuple[str, Path, int]:  # noqa: ANN001
    kernel.execute(FILL, timeout=120)
    images = os.path.join(client.work_dir(), f"source-{kernel.pid}")
    client.dump(kernel.pid, images)
    kernel.execute("blob[:8] = b'changed!'")
    kept = tmp_path / "pages"
    kept.mkdir()
    total = 0
    for name in os.listdir(images):
        if name.startswith("pages-"):
            total += os.path.getsize(Path(images) / name)
            shutil.move(Path(images) / name, kept / name)
    return images, kept, total


def test_pages_come_from_the_source_and_every_one_arrives(client, kernel: Kernel, trees,
                                                          tmp_path) -> None:
    images, kept, total = _dump_without_pages(client, kernel, tmp_path)
    source = FileSource(Path(images) / "pages.sock", kept)
    try:
        restored = client.restore(images, replace_pid=kernel.pid, lazy=True,
                                  page_source="pages.sock")
        trees.add(restored.pid)
        assert restored.pages is not None, restored
        kernel.wait_answering(timeout=60)
        assert kernel.evaluate(ok=CHECK, head="bytes(blob[:8]) != b'changed!'") == {
            "ok": "True", "head": "True"}
        from test_helper_lazy_restore import _wait

        done = _wait(lambda: (s := client.status(restored.pid).pages)["state"] != "streaming"
                     and s, "the page daemon to finish")
        assert done["state"] == "resident", done
        source.thread.join(timeout=60)
        # every page came from the source, once (a range the daemon or a fault wants while
        # the stream fetches it is waited for, not asked again), and each file's last page
        # once more: the helper's probe of the file's length before the kernel was touched;
        # in ranges of the page files only
        probes = 4096 * len(os.listdir(kept))
        assert source.served == total + probes, (source.served, total)
        assert {name for name, _, _ in source.asked} <= set(os.listdir(kept))
        assert not any(n.startswith("pages-") for n in os.listdir(images))
    finally:
        source.close()
    client.release(images)


def test_the_kernel_answers_without_asking_for_its_small_memory_page_by_page(
        client, kernel: Kernel, trees, tmp_path) -> None:
    """The pages of short runs (the interpreter's heaps and stacks, small objects) come back
    with CRIU's restore, filled in by the helper in a few asks (page_source.eager_entries);
    the 256 MiB blob stays lazy. Left lazy, each page of those heaps the kernel touched was a
    fault of its own: the first answer of an ipykernel took about 1,500 (187 asks)."""
    from test_helper_lazy_restore import _wait

    from infinijup_helper.page_source import EAGER_TOTAL

    images, kept, total = _dump_without_pages(client, kernel, tmp_path)
    source = FileSource(Path(images) / "pages.sock", kept, stream_held=True)
    try:
        restored = client.restore(images, replace_pid=kernel.pid, lazy=True,
                                  page_source="pages.sock")
        trees.add(restored.pid)
        filled, asks = source.served, source.asked_for_faults
        # the file's last page (the helper's probe of its length), then the short runs
        assert 4096 * len(os.listdir(kept)) < filled < EAGER_TOTAL + (1 << 20), filled
        source.stream_go.set()
        kernel.wait_answering(timeout=60)
        assert kernel.evaluate(x="1 + 1") == {"x": "2"}
        # a few: the daemon's first asks of its own stream go on that connection too
        assert source.asked_for_faults - asks <= 16, source.asked[asks:]
        assert kernel.evaluate(ok=CHECK) == {"ok": "True"}
        done = _wait(lambda: (s := client.status(restored.pid).pages)["state"] != "streaming"
                     and s, "the page daemon to finish")
        assert done["state"] == "resident", done
    finally:
        source.close()
    client.release(images)


def test_a_source_that_stops_mid_stream_ends_the_kernel_with_the_reason(
        client, kernel: Kernel, trees, tmp_path) -> None:
    images, kept, total = _dump_without_pages(client, kernel, tmp_path)
    # the stream held until the restore has answered (it runs from the page daemon's start:
    # a source that stopped earlier would fail the restore itself; a hold by bytes could
    # come before CRIU is done with the pages it reads itself), then stopping at its next ask
    source = FileSource(Path(images) / "pages.sock", kept, stream_held=True)
    try:
        restored = client.restore(images, replace_pid=kernel.pid, lazy=True,
                                  page_source="pages.sock")
        trees.add(restored.pid)
        source.stop_after = 0
        source.stream_go.set()
        assert source.stopped.wait(120), "the source was never asked again"
        from test_helper_lazy_restore import _wait

        status = _wait(lambda: (s := client.status(restored.pid)).pages["state"] != "streaming"
                       and s, "the page daemon to end")
        assert status.pages["state"] == "failed", status
        assert "the source stopped answering" in status.pages["error"], status.pages["error"]
        _wait(lambda: not client.status(restored.pid).alive, "the kernel to be ended")
    finally:
        source.close()
    # the snapshot is intact: with its page files back, a restore has every byte
    for name in os.listdir(kept):
        shutil.copy2(kept / name, Path(images) / name)
    os.unlink(Path(images) / "pages.sock")
    again = client.restore(images)
    trees.add(again.pid)
    kernel.wait_answering(timeout=60)
    assert kernel.evaluate(ok=CHECK) == {"ok": "True"}
    client.release(images)


def test_a_socket_served_by_another_account_is_refused(client, kernel: Kernel, trees,
                                                       tmp_path) -> None:
    images, _, _ = _dump_without_pages(client, kernel, tmp_path)
    where = str(Path(images) / "pages.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another account serves the socket the caller named (listen() sets the
        try:      # credentials a client sees)
            other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            other.bind(where)
            os.setgid(65534)
            os.setuid(65534)
            other.listen(1)
            os.write(w, b"1")
            other.accept()[0].recv(1)
        finally:
            os._exit(0)
    try:
        os.read(r, 1)
        with pytest.raises(InfinijupError, match="served by uid 65534"):
            client.restore(images, replace_pid=kernel.pid, lazy=True, page_source="pages.sock")
        assert kernel.evaluate(head="bytes(blob[:8])") == {"head": repr(b"changed!")}
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    client.release(images)



def test_the_stream_outlives_a_helper_killed_while_it_runs(trees, tmp_path) -> None:
    """The helper SIGKILLed while the kernel waits for pages from the source: the helper's
    page-source process and CRIU's daemon carry on without it, every byte arrives."""
    import signal

    from helperkit import HelperDaemon, make_base, start_kernel

    from infinijup.helper_client import HelperClient

    helper = HelperDaemon(make_base())
    helper.start()
    kernel = None
    source = None
    try:
        client = HelperClient(helper.socket_path, timeout=120)
        kernel = start_kernel(client, trees, name="streaming")
        images, kept, total = _dump_without_pages(client, kernel, tmp_path)
        # the stream waits until the restore has answered (it could otherwise pass the hold
        # before CRIU is done with the pages it reads itself): then the source holds a third
        # of the way through what is left
        source = FileSource(Path(images) / "pages.sock", kept, stream_held=True)
        restored = client.restore(images, replace_pid=kernel.pid, lazy=True,
                                  page_source="pages.sock")
        trees.add(restored.pid)
        with source.lock:
            source.hold_after = source.served + (total - source.served) // 3
        source.stream_go.set()
        kernel.kc.execute(CHECK, store_history=False)  # reads every page: it must wait
        assert source.holding.wait(120), "the source was never asked for a third of the pages"
        helper.stop(signal.SIGKILL)
        source.go.set()
        kernel.wait_answering(timeout=120)
        assert kernel.evaluate(ok=CHECK) == {"ok": "True"}
        source.thread.join(timeout=120)
        assert source.served >= total
    finally:
        if source is not None:
            source.go.set()
            source.close()
        if kernel is not None:
            kernel.close()
        helper.stop(signal.SIGKILL)
        helper.remove()
