"""The reaper and an operation on the same tree: once the reaper has begun to reap a tree that
exited, no operation may take hold of it (its pidfd is about to close), and the operation is
told the tree is gone. Before, an operation that took hold of it in between could find the
pidfd closed under it (EBADF: a failed restore's clean-up then left the images' pids taken,
seen on the GPU host), or the reaper could close a descriptor the operation had reaped."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helperkit import HelperDaemon, kernel_env, needs_root_and_criu, own_helper, wait_for

from infinijup.errors import InfinijupError

pytestmark = needs_root_and_criu


@pytest.fixture(scope="module")
def helper() -> Iterator[HelperDaemon]:
    """This module's own helper, with hold points (holds.py)."""
    with own_helper(holds=True) as daemon:
        yield daemon


def test_an_operation_on_a_tree_being_reaped_is_told_it_is_gone(client, trees, helper) -> None:
    work = client.work_dir()
    root = trees.add(client.spawn(["/bin/sleep", "1000"], kernel_env(), work,
                                  os.path.join(work, "reaped.log")))
    point = Path(helper.holds_dir) / "tree_reaping"
    reached = Path(f"{point}.reached")
    point.touch()
    try:
        os.kill(root, signal.SIGKILL)
        wait_for(reached.exists, what="the reaper at the tree")
        with pytest.raises(InfinijupError) as told:
            client.kill(root)
        assert told.value.reason == "no_such_process", told.value
    finally:
        point.unlink()
    wait_for(lambda: root not in client.trees(), what="the tree reaped")
    # the reaper went on: a new tree is watched and reaped as before
    again = trees.add(client.spawn(["/bin/sleep", "1000"], kernel_env(), work,
                                   os.path.join(work, "again.log")))
    client.kill(again)
    assert "Traceback" not in helper.log(), helper.log()
