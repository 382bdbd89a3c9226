"""SIGKILL of the Jupyter server (a real ``jupyter server`` process) in the middle of a snapshot.

The kernel is not the server's child (the helper launched it), so it runs on; the store keeps
no partial commit and passes ``check --read-data``; ``gc`` removes what the ingest had written;
a new server on the same store and helper finds the notebook's history, its next snapshot
works, and the images the dead server left in the helper's work dir are removed.

Killed at the phase named, never after a delay: in the dump, while the helper waits at a hold
point (infinijup_helper/holds.py) with CRIU started; in the store ingest, by the store's own
crash point (``INFINIJUP_STORE_CRASH_AT``, infinijup/store/faults.py) once the snapshot's packs
and commit object are written, before its thread moves.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time

import psutil
import pytest
from reliakit import (
    BIG,
    ServerProcess,
    assert_store_ok,
    make_base,
    needs_helper,
    store_cli,
    store_state,
    tree_bytes,
)

pytestmark = [needs_helper, pytest.mark.timeout(240)]

NOTEBOOK = "crash.ipynb"


def _kernel_root(kernel_id: str) -> int:
    for proc in psutil.process_iter(["cmdline"]):
        if any(f"kernel-{kernel_id}.json" in a for a in (proc.info["cmdline"] or [])):
            return proc.ppid()
    raise AssertionError(f"no process for kernel {kernel_id}")


@pytest.fixture
def server_base():
    base = make_base()
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("phase", ["dump", "store"])
def test_server_killed_mid_snapshot(helper_up, server_base, store_path, phase):
    from infinijup.helper_client import HelperClient

    helper = HelperClient(helper_up.socket_path, timeout=120)
    notebooks = server_base / "notebooks"
    # the base snapshot is the store's first commit, the one killed mid-ingest its second
    crash = {"INFINIJUP_STORE_CRASH_AT": "after_commit:2"} if phase == "store" else {}
    first = ServerProcess(server_base / "a", helper_up.socket_path, store_path, notebooks,
                          extra_env=crash)
    first.start()
    root = None
    try:
        kernel_id = first.open_session(NOTEBOOK)
        kernel = first.kernel_client(kernel_id)
        root = _kernel_root(kernel_id)
        kernel.execute("x = 'base'")
        code, base = first.request("POST", "/infinijup/snapshot", {"kernel_id": kernel_id})
        assert code == 201, base
        kernel.execute(BIG.format(mib=300, seed=41), timeout=120)
        digest = kernel.evaluate(d="big_digest")["d"]
        before = store_state(store_path)
        store_before = tree_bytes(store_path)

        outcome = {}
        if phase == "dump":
            helper_up.holds.arm("criu_dump_request")
        snap = threading.Thread(target=lambda: outcome.update(r=_try_snapshot(first, kernel_id)))
        snap.start()
        if phase == "dump":  # the request has reached the helper: CRIU runs
            asyncio.run(helper_up.holds.reached("criu_dump_request"))
            first.sigkill()
            helper_up.holds.release("criu_dump_request")
        else:
            assert first.wait_exited() == -signal.SIGKILL  # at its crash point
            assert tree_bytes(store_path) > store_before + (200 << 20)  # the ingest's packs
        snap.join(120)
        assert outcome["r"] == "connection lost"

        # the kernel runs on, state intact
        kernel.wait_answering()
        assert kernel.evaluate(d="__import__('hashlib').sha256(big).hexdigest()")["d"] == digest
        assert helper.status(root).alive
        # no partial commit; the store checks out; gc removes what the ingest wrote
        assert store_state(store_path) == before
        assert_store_ok(store_path)
        gc = store_cli(store_path, "gc")
        assert gc.returncode == 0, gc.stderr
        check = store_cli(store_path, "check", "--read-data")
        assert check.returncode == 0 and "warning" not in check.stdout.lower(), check.stdout
        assert tree_bytes(store_path) <= store_before + (1 << 20)
        # the helper finished the dump it was asked for (a client hanging up does not cancel
        # a dump) and published it; the dead server never removed it
        deadline = time.monotonic() + 60
        while len(helper_up.user_entries()["images"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(helper_up.user_entries()["images"]) == 1, helper_up.user_entries()

        # a new server on the same store and helper
        second = ServerProcess(server_base / "b", helper_up.socket_path, store_path, notebooks)
        second.start()
        try:
            new_id = second.open_session(NOTEBOOK)
            code, hist = second.request("GET", f"/infinijup/history?kernel_id={new_id}")
            assert code == 200 and [c["id"] for c in hist["commits"]] == [base["commit"]]
            code, snap2 = second.request("POST", "/infinijup/snapshot", {"kernel_id": new_id})
            # a fresh kernel: a new root next to main (engine/heads.py)
            assert code == 201 and snap2["parents"] == [] and snap2["thread"] == "main-1", snap2
            # what the dead server left in the helper's work dir is gone now
            assert helper_up.user_entries() == {"images": [], "restore": []}
            code, _ = second.request("DELETE", f"/api/kernels/{new_id}")
            assert code == 204
        finally:
            second.stop()
        assert_store_ok(store_path)
        kernel.close()
    finally:
        first.stop()
        if root is not None and psutil.pid_exists(root):
            helper.kill(root)  # the orphaned kernel: nobody else will end it
        for leftover in ("images", "restore"):
            path = os.path.join(helper_up.work_dir, "0", leftover)
            if os.path.isdir(path):
                shutil.rmtree(path)


def _try_snapshot(server: ServerProcess, kernel_id: str) -> str:
    try:
        code, body = server.request("POST", "/infinijup/snapshot", {"kernel_id": kernel_id})
    except OSError:
        return "connection lost"
    return f"answered {code}: {body}"
