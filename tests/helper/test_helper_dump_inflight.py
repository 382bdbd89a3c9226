"""A connection made to a kernel's unix listener and dropped before the kernel accepted it: if
the dump froze the kernel in between, CRIU refuses ("Found a closed in-flight socket": it cannot
tell what such a connection sent). That is the server's own quick connections racing a
snapshot (a client that connects and closes while the kernel is frozen), seen once in CI. The
helper dumps again, as it does for a connection accepted after it listed the sockets: by then
the kernel has accepted it."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helperkit import HelperDaemon, Kernel, needs_root_and_criu, own_helper, wait_for

pytestmark = needs_root_and_criu

LISTEN = """
import socket, threading
listener = socket.socket(socket.AF_UNIX)
listener.bind({path!r})
listener.listen(8)
accepted = []
def serve():
    while True:
        accepted.append(listener.accept()[0])
threading.Thread(target=serve, daemon=True).start()
"""


@pytest.fixture(scope="module")
def helper() -> Iterator[HelperDaemon]:
    """This module's own helper, with hold points (infinijup_helper/holds.py)."""
    with own_helper(holds=True) as daemon:
        yield daemon


def test_a_connection_dropped_while_the_kernel_was_frozen_is_dumped_again(
        client, kernel: Kernel, helper, tmp_path) -> None:
    path = str(tmp_path / "listener")
    kernel.execute(LISTEN.format(path=path))
    holds = Path(helper.holds_dir)
    frozen = holds / "criu_dump_query-ext-files"  # the tree frozen, nothing dumped yet
    frozen.touch()
    images = os.path.join(client.work_dir(), f"inflight-{kernel.pid}")
    outcome: dict = {}

    def dump() -> None:
        try:
            outcome["dumped"] = client.dump(kernel.pid, images)
        except Exception as exc:  # noqa: BLE001 - looked at below
            outcome["error"] = exc

    worker = threading.Thread(target=dump)
    worker.start()
    try:
        wait_for(lambda: Path(f"{frozen}.reached").exists(), what="the tree frozen")
        with socket.socket(socket.AF_UNIX) as c:  # connects (the backlog takes it), then goes
            c.connect(path)
    finally:
        frozen.unlink()
    worker.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["dumped"].image_bytes > 0
    assert kernel.evaluate(n="len(accepted)") == {"n": "1"}  # accepted once thawed
