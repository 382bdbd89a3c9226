"""A real ipykernel: spawn through the helper, dump, diverge, restore over it, check state."""

from __future__ import annotations

import os

import pytest
from helperkit import Kernel, needs_root_and_criu, read_nspid

from infinijup.errors import HelperError

pytestmark = needs_root_and_criu


def test_kernel_dump_restore_replace_keeps_variables(client, kernel: Kernel, trees) -> None:
    kernel.execute("x = 1\nimport os")
    assert kernel.evaluate(pid="os.getpid()")["pid"] == "2"  # nsinit is 1, the kernel 2

    images = os.path.join(client.work_dir(), f"kernel-images-{kernel.pid}")
    phases_seen: list[str] = []
    dumped = client.dump(kernel.pid, images, on_progress=lambda ph, d: phases_seen.append(ph))
    assert dumped.image_bytes > 1_000_000
    assert "dump" in dumped.phases and dumped.duration_s > 0
    assert "dump" in phases_seen
    st = os.stat(images)
    assert (st.st_uid, oct(st.st_mode & 0o777)) == (0, "0o700")

    kernel.execute("x = 2")
    assert kernel.evaluate(x="x")["x"] == "2"

    # Restoring beside the running original cannot work (its ports are taken): CRIU fails,
    # nothing from the images is left running, and the original is untouched.
    with pytest.raises(HelperError) as failed:
        client.restore(images)
    assert failed.value.reason == "criu_failed"
    assert "Error" in str(failed.value)
    assert kernel.evaluate(x="x")["x"] == "2"

    restored = client.restore(images, replace_pid=kernel.pid)
    trees.add(restored.pid)
    assert set(restored.phases) >= {"kill", "restore"}
    assert not client.status(kernel.pid).alive
    assert client.status(restored.pid).alive
    assert read_nspid(restored.pid)[-1] == 1

    kernel.wait_answering(timeout=20)
    assert kernel.evaluate(x="x", pid="os.getpid()") == {"x": "1", "pid": "2"}

    client.kill(restored.pid)
    status = client.status(restored.pid)
    assert not status.alive and status.exit_code == -9
    client.release(images)
    assert not os.path.exists(images)
