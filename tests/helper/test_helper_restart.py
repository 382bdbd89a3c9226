"""Killing the helper (SIGKILL) leaves its kernels running; a new helper can dump and kill them."""

from __future__ import annotations

import os
import shutil
import signal

from helperkit import HelperDaemon, make_base, needs_root_and_criu, start_kernel

pytestmark = needs_root_and_criu


def test_kernel_survives_helper_sigkill_and_new_helper_can_dump_it(trees) -> None:
    from infinijup.helper_client import HelperClient

    first = HelperDaemon(make_base())
    first.start()
    second = HelperDaemon(first.base)
    kernel = None
    try:
        client = HelperClient(first.socket_path, timeout=60)
        kernel = start_kernel(client, trees, name="survivor")
        kernel.execute("y = 41")
        first.stop(signal.SIGKILL)

        assert os.path.exists(f"/proc/{kernel.pid}")
        kernel.wait_answering()
        assert kernel.evaluate(y="y + 1")["y"] == "42"

        second.start()  # same socket, same work dir: a stale socket file is replaced
        client = HelperClient(second.socket_path, timeout=60)
        assert client.status(kernel.pid).alive
        images = os.path.join(client.work_dir(), "after-restart")
        client.dump(kernel.pid, images)
        restored = trees.add(client.restore(images, replace_pid=kernel.pid).pid)
        kernel.wait_answering()
        assert kernel.evaluate(y="y")["y"] == "41"
        client.kill(restored)
        assert not os.path.exists(f"/proc/{restored}")
    finally:
        if kernel is not None:
            kernel.close()
        first.stop(signal.SIGKILL)
        second.stop()
        shutil.rmtree(first.base, ignore_errors=True)
