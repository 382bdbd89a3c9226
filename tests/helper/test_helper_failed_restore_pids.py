"""With no PID namespace (the GPU hosts), a restore brings the snapshot's own pids back. A
restore that CRIU fails after it made the tasks must leave those pids free at once, so that the
next restore of the same images works (checkpoint.reap_failed_restore), not only after the
helper's reaper has swept its stray zombies (5 to 10 s later)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helperkit import HelperDaemon, Kernel, needs_root_and_criu, own_helper, wait_for

from infinijup.errors import InfinijupError

pytestmark = needs_root_and_criu


@pytest.fixture(scope="module")
def helper() -> Iterator[HelperDaemon]:
    """This module's own helper: no PID namespace, with hold points (holds.py)."""
    with own_helper("--pid-namespace", "never", holds=True) as daemon:
        yield daemon


def _restores_again_at_once(client, kernel: Kernel, images: str) -> None:  # noqa: ANN001
    again = client.restore(images)  # no "File exists" for a pid of the images
    try:
        kernel.pid = again.pid
        kernel.wait_answering(timeout=60)
        assert kernel.evaluate(x="x") == {"x": "41"}
    finally:
        client.kill(again.pid)  # the whole tree: with no PID namespace, a SIGKILL of its
        # root (the fixtures' cleanup) would leave the kernel process running
    client.release(images)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_restore_failed_after_its_tasks_were_made_leaves_their_pids_free(
        client, kernel: Kernel, trees, helper) -> None:
    kernel.execute("x = 41")
    images = os.path.join(client.work_dir(), f"failed-{kernel.pid}")
    client.dump(kernel.pid, images)
    client.kill(kernel.pid)  # its pids are free: the snapshot's tree gets them back

    # CRIU held once it has made the tree (frozen, not yet resumed); the kernel process (the
    # root's child) killed there, so that CRIU fails the restore after making its tasks
    point = Path(helper.holds_dir) / "criu_restore_post-restore"
    reached = Path(f"{point}.reached")
    reached.unlink(missing_ok=True)
    point.touch()
    outcome: dict = {}

    def first() -> None:
        try:
            outcome["restored"] = client.restore(images)
        except InfinijupError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=first)
    worker.start()
    try:
        wait_for(reached.exists, what="CRIU at post-restore")
        for child in _children(kernel.pid):
            os.kill(child, signal.SIGKILL)
    finally:
        point.unlink()
        worker.join(timeout=120)
        reached.unlink(missing_ok=True)
    if "restored" in outcome:
        client.kill(outcome["restored"].pid)
    assert "error" in outcome, outcome  # CRIU failed the restore, having made the tasks

    _restores_again_at_once(client, kernel, images)


def test_a_restore_failed_before_its_tasks_took_their_names_leaves_their_pids_free(
        client, kernel: Kernel, trees, helper, tmp_path) -> None:
    """CRIU fails early (a directory the kernel had open has another mode since): its root
    task ends still named ``criu``, and is reaped at once all the same."""
    opened = tmp_path / "opened"
    opened.mkdir(mode=0o700)
    kernel.execute(f"import os\nx = 41\ndfd = os.open({str(opened)!r}, os.O_RDONLY)")
    images = os.path.join(client.work_dir(), f"early-{kernel.pid}")
    client.dump(kernel.pid, images)
    client.kill(kernel.pid)
    os.chmod(opened, 0o755)
    with pytest.raises(InfinijupError) as failed:
        client.restore(images)
    assert "bad mode" in str(failed.value), failed.value
    os.chmod(opened, 0o700)
    _restores_again_at_once(client, kernel, images)
