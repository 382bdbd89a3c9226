"""The parts of the encrypted local store built so far (local_crypto.py): key slots in the
store's directory, keyed ids, objects and pack headers sealed one by one.

Real files and a real store: the objects sealed are those a plain store wrote for an image
holding a planted secret, and the same scan that finds the secret, its BLAKE3 and the plain
ids in the plain store's packs (the control) finds nothing in the sealed copies.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
from conftest import random_bytes, subprocess_env

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.errors import (
    ChecksumMismatch,
    CorruptObject,
    RemoteError,
    RemoteKeyError,
    StoreWrongKey,
)
from infinijup.store.gc import gc
from infinijup.store.keys import Credentials, KdfParams
from infinijup.store.layout import pack_files, read_packs
from infinijup.store.local_crypto import (
    ENCRYPTION_FILE,
    OVERHEAD,
    add_key,
    change_password,
    init_keys,
    is_encrypted,
    list_keys,
    open_keys,
    remove_key,
)
from infinijup.store.packs import DELTA, SEALED, decode_payload, read_pack_header
from infinijup.store.remote import pull, push

SECRET = "sk-live-PLANTED-local-4b1d9e3a7c5f2e80"
FAST = KdfParams(time_cost=1, memory_kib=1024, parallelism=1)  # tests only


def _password(path: Path, text: str) -> Credentials:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return Credentials.build(password_file=path)


def _image(root: Path) -> Path:
    root.mkdir(parents=True)
    data = bytearray(random_bytes(3 << 20, 7))
    for at in (100_000, 2 << 20):
        data[at:at + len(SECRET)] = SECRET.encode()
    (root / "pages.img").write_bytes(bytes(data))
    (root / "open-file").write_text(SECRET)
    return root


def _objects(repo: Repository) -> list[tuple[int, int, bytes, int, bytes]]:
    """Every object the store wrote: (type, compression, plain id, raw length, payload)."""
    out = []
    for name, path in pack_files(repo).items():
        _header, entries = read_pack_header(path)
        data = path.read_bytes()
        for e in entries:
            out.append((e.type, e.compression, e.id, e.raw_length,
                        data[e.offset:e.offset + e.length]))
        assert name
    return out


def _needles(image: Path, objects: list[tuple[int, int, bytes, int, bytes]]
             ) -> dict[str, bytes]:
    raw = {"blake3(secret)": blake3.blake3(SECRET.encode()).digest()}
    for p in image.iterdir():
        raw[f"blake3({p.name})"] = blake3.blake3(p.read_bytes()).digest()
    for _t, _c, oid, _n, _p in objects:
        raw[f"id {oid.hex()[:12]}"] = oid
    out = {"secret": SECRET.encode()}
    for what, value in raw.items():
        out[what], out[what + " hex"] = value, value.hex().encode()
    return out


def _scan(root: Path, needles: dict[str, bytes]) -> set[str]:
    """What of ``needles`` any file under ``root`` (content or name) holds."""
    found = set()
    for p in root.rglob("*"):
        body = p.read_bytes() if p.is_file() else b""
        found |= {w for w, n in needles.items() if n in body or n in p.name.encode()}
    return found


def test_keys_open_with_their_slots_and_refuse_others(tmp_path: Path) -> None:
    store = tmp_path / "store"
    pw = _password(tmp_path / "pw", "correct horse")
    made = init_keys(store, pw, label="laptop", kdf=FAST)
    assert is_encrypted(store) and (store / ENCRYPTION_FILE).is_file()
    assert (store / "keys" / made.slot).stat().st_mode & 0o077 == 0
    again = open_keys(store, pw)  # what another process does at open: the same keys
    assert again.key.object_id(b"x") == made.key.object_id(b"x")

    with pytest.raises(StoreWrongKey, match="no key slot"):
        open_keys(store, _password(tmp_path / "wrong", "wrong horse"))
    with pytest.raises(StoreWrongKey, match="give its password"):
        open_keys(store, Credentials())
    with pytest.raises(StoreWrongKey, match="not an encrypted store"):
        open_keys(tmp_path / "plain", pw)

    key_file = tmp_path / "store.key"
    slot2 = add_key(store, again, Credentials.build(key_file=key_file), kdf=FAST)
    assert key_file.is_file()
    assert [s.type for s in list_keys(store)] == ["password", "key-file"]
    by_file = open_keys(store, Credentials.build(key_file=key_file))
    assert by_file.slot == slot2 and by_file.key.object_id(b"x") == made.key.object_id(b"x")
    with pytest.raises(RemoteKeyError, match="the one that opened"):
        remove_key(store, slot2, by_file)
    remove_key(store, made.slot, by_file)  # the password's slot removed
    with pytest.raises(StoreWrongKey, match="no key slot"):
        open_keys(store, pw)
    with pytest.raises(RemoteKeyError, match="no key slot"):
        remove_key(store, made.slot, by_file)  # gone already
    new_pw = _password(tmp_path / "pw2", "battery staple")
    slot3 = change_password(store, by_file, new_pw, kdf=FAST)
    assert {s.id for s in list_keys(store)} == {slot3}
    assert open_keys(store, new_pw).key.object_id(b"x") == made.key.object_id(b"x")
    with pytest.raises(StoreWrongKey):
        open_keys(store, Credentials.build(key_file=key_file))


def test_keyed_ids_hide_plain_hashes(tmp_path: Path) -> None:
    a = init_keys(tmp_path / "a", _password(tmp_path / "pa", "a"), kdf=FAST).key
    b = init_keys(tmp_path / "b", _password(tmp_path / "pb", "a"), kdf=FAST).key
    data = SECRET.encode() * 1000
    assert a.object_id(data) == a.object_id(bytes(data))  # same content, same id: dedup
    assert a.object_id(data) != blake3.blake3(data).digest()
    assert a.object_id(data) != b.object_id(data)  # another store's key: another id
    h = a.hasher()
    h.update(data[:777])
    h.update(data[777:])
    assert h.digest() == a.object_id(data)


def test_sealed_objects_of_a_real_store_hide_it_and_round_trip(tmp_path: Path) -> None:
    image = _image(tmp_path / "img")
    repo = Repository.init(tmp_path / "plain", pack_size=1 << 20)
    try:
        repo.commit_dir(image, thread="nb", message="one")
        objects = _objects(repo)
    finally:
        repo.close()
    needles = _needles(image, objects)
    # The control: the plain store's packs hold the secret and the plain ids.
    assert {"secret", "id " + objects[0][2].hex()[:12]} <= _scan(tmp_path / "plain", needles)

    key = init_keys(tmp_path / "enc", _password(tmp_path / "pw", "pw"), kdf=FAST).key
    sealed_dir = tmp_path / "enc" / "sealed"
    sealed_dir.mkdir()
    stored = []
    for i, (typ, comp, oid, raw, payload) in enumerate(objects):
        kid = key.object_id(_plain(payload, oid, comp, raw))
        body = key.seal(kid, typ, comp, payload)
        assert len(body) == len(payload) + OVERHEAD == len(payload) + SEALED
        (sealed_dir / f"{i:06d}").write_bytes(body)
        stored.append((typ, comp, kid, raw, oid))
    assert _scan(tmp_path / "enc", needles) == set()

    for i, (typ, comp, kid, raw, oid) in enumerate(stored):
        payload = key.open(kid, typ, comp, (sealed_dir / f"{i:06d}").read_bytes())
        assert blake3.blake3(_plain(payload, oid, comp, raw)).digest() == oid
        assert key.object_id(_plain(payload, oid, comp, raw)) == kid

    typ, comp, kid, _raw, _oid = stored[0]
    body = bytearray((sealed_dir / "000000").read_bytes())
    body[len(body) // 2] ^= 1
    with pytest.raises(CorruptObject, match="does not authenticate"):
        key.open(kid, typ, comp, bytes(body))
    good = (sealed_dir / "000000").read_bytes()
    with pytest.raises(CorruptObject):  # under another object's id
        key.open(stored[1][2], typ, comp, good)
    with pytest.raises(CorruptObject):  # claimed stored another way
        key.open(kid, typ, comp ^ 1, good)
    with pytest.raises(CorruptObject, match="truncated"):
        key.open(kid, typ, comp, good[:OVERHEAD - 1])
    other = init_keys(tmp_path / "other", _password(tmp_path / "po", "pw"), kdf=FAST).key
    with pytest.raises(CorruptObject):  # another store's key
        other.open(kid, typ, comp, good)


def test_sealed_pack_headers(tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "plain", pack_size=1 << 20)
    try:
        repo.commit_dir(_image(tmp_path / "img"), thread="nb")
        packs, problems = read_packs(repo)
        assert packs and not problems
        header, entries = read_pack_header(next(iter(pack_files(repo).values())))
    finally:
        repo.close()
    key = init_keys(tmp_path / "enc", _password(tmp_path / "pw", "pw"), kdf=FAST).key
    sealed = key.seal_header(header, 1)
    assert all(e.id not in sealed for e in entries)
    assert key.open_header(sealed, 1) == header
    with pytest.raises(CorruptObject):
        key.open_header(sealed, 2)
    flipped = bytearray(sealed)
    flipped[-1] ^= 0x80
    with pytest.raises(CorruptObject, match="does not authenticate"):
        key.open_header(bytes(flipped), 1, "p")


def _plain(payload: bytes, oid: bytes, comp: int, raw: int) -> bytes:
    assert comp != DELTA  # a first snapshot has no page deltas
    return decode_payload(payload, oid, comp, raw, "test")


def test_key_files_stay_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = init_keys(tmp_path / "s", Credentials.build(key_file=tmp_path / "k"), kdf=FAST)
    finally:
        os.umask(old)
    assert (tmp_path / "k").stat().st_mode & 0o077 == 0
    assert (tmp_path / "s" / "keys" / made.slot).stat().st_mode & 0o077 == 0
    with pytest.raises(Exception, match="has keys already"):
        init_keys(tmp_path / "s", Credentials.build(key_file=tmp_path / "k"))


# -- an encrypted store ---------------------------------------------------------------------

def _creds(tmp_path: Path, text: str = "laptop password") -> Credentials:
    return _password(tmp_path / f"pw-{len(text)}-{text[:4]}", text)


def _fill(repo: Repository, image: Path) -> list[tuple[str, bytes]]:
    """Three snapshots of ``image`` on a thread named after the secret, the image changed a
    little between them: (commit id, the image's bytes) of each."""
    pages = image / "pages.img"
    out = []
    for step in range(3):
        if step:
            data = bytearray(pages.read_bytes())
            for at in range(step * 4096, len(data), 97 * 4096):  # ~1% of the pages
                data[at:at + 64] = bytes([step]) * 64
            pages.write_bytes(bytes(data))
        c = repo.commit_dir(image, thread=f"nb/{SECRET}", message=f"step {step} {SECRET}",
                            metadata={"token": SECRET, "step": step})
        out.append((c.id, pages.read_bytes()))
    return out


def test_encrypted_store_round_trip_and_dedup(tmp_path: Path) -> None:
    creds = _creds(tmp_path)
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20, encrypt=creds, kdf=FAST)
    snaps = _fill(repo, _image(tmp_path / "img"))
    first = repo.get_commit(snaps[0][0])
    repo.close()

    repo = Repository.open(tmp_path / "store", credentials=creds)  # unlocked at open
    try:
        for i, (cid, data) in enumerate(snaps):
            checkout_dir(repo, cid, tmp_path / f"out{i}")
            assert (tmp_path / f"out{i}" / "pages.img").read_bytes() == data
            assert (tmp_path / f"out{i}" / "open-file").read_text() == SECRET
        # dedup: a snapshot after ~1% of the pages changed stores as few new chunks as a
        # plain store does from the same images, a small part of the first
        with Repository.init(tmp_path / "plain", pack_size=1 << 20) as plain:
            plain_snaps = _fill(plain, _image(tmp_path / "img-plain"))
            for (cid, _), (pid, _) in zip(snaps[1:], plain_snaps[1:], strict=True):
                later, plain_later = repo.get_commit(cid), plain.get_commit(pid)
                assert later.stats["new_chunks"] == plain_later.stats["new_chunks"]
                assert later.stats["delta_chunks"] == plain_later.stats["delta_chunks"]
                assert later.stats["new_chunks"] < first.stats["new_chunks"] // 4
                assert later.stats["stored_bytes"] < first.stats["stored_bytes"] // 10
        assert repo.threads() == {f"nb/{SECRET}": snaps[2][0]}
        assert [c.id for c in repo.log(f"nb/{SECRET}")] == [c for c, _ in reversed(snaps)]
        assert [c.id for c in repo.find_commits(token=SECRET)] == [c for c, _ in
                                                                   reversed(snaps)]
        assert [c.id for c in repo.find_commits(step=1, thread=f"nb/{SECRET}")] == [
            snaps[1][0]]
        assert repo.find_commits(token="another") == []
        assert repo.resolve(snaps[0][0][:10]) == snaps[0][0]
    finally:
        repo.close()


def test_nothing_under_an_encrypted_store_reveals_its_content(tmp_path: Path) -> None:
    plain = Repository.init(tmp_path / "plain", pack_size=1 << 20)
    _fill(plain, _image(tmp_path / "img-plain"))
    needles = _needles(tmp_path / "img-plain", _objects(plain))
    for cid in plain.index.commit_ids():
        needles[f"commit {cid[:12]}"] = cid.encode()
    needles["thread"] = f"nb/{SECRET}".encode()
    plain.close()
    found = _scan(tmp_path / "plain", needles)  # the control: the same scan finds them
    assert {"secret", "blake3(secret)", "blake3(open-file)", "thread"} <= found
    assert sum(w.startswith("id ") for w in found) > 10
    assert any(w.startswith("commit ") for w in found)

    repo = Repository.init(tmp_path / "enc", pack_size=1 << 20, encrypt=_creds(tmp_path),
                           kdf=FAST)
    _fill(repo, _image(tmp_path / "img-enc"))  # the same images, made the same way
    assert (tmp_path / "img-enc" / "pages.img").read_bytes() == \
        (tmp_path / "img-plain" / "pages.img").read_bytes()
    repo.index.truncate_journal()
    repo.close()
    assert _scan(tmp_path / "enc", needles) == set()


def test_wrong_or_removed_keys_are_refused(tmp_path: Path) -> None:
    creds = _creds(tmp_path)
    repo = Repository.init(tmp_path / "store", encrypt=creds, kdf=FAST)
    cid = repo.commit_dir(_image(tmp_path / "img"), thread="nb").id
    repo.close()
    with pytest.raises(StoreWrongKey, match="no key slot"):
        Repository.open(tmp_path / "store", credentials=_creds(tmp_path, "not it"))
    with pytest.raises(StoreWrongKey, match="give its password"):
        Repository.open(tmp_path / "store", credentials=Credentials())
    key_file = tmp_path / "store.key"
    opened = open_keys(tmp_path / "store", creds)
    slot = add_key(tmp_path / "store", opened, Credentials.build(key_file=key_file), kdf=FAST)
    by_file = open_keys(tmp_path / "store", Credentials.build(key_file=key_file))
    remove_key(tmp_path / "store", opened.slot, by_file)
    with pytest.raises(StoreWrongKey, match="no key slot"):  # its slot removed
        Repository.open(tmp_path / "store", credentials=creds)
    with Repository.open(tmp_path / "store",
                         credentials=Credentials.build(key_file=key_file)) as repo:
        assert repo.threads() == {"nb": cid} and by_file.slot == slot


def test_a_flipped_byte_in_a_pack_is_refused_on_checkout(tmp_path: Path) -> None:
    creds = _creds(tmp_path)
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20, encrypt=creds, kdf=FAST)
    try:
        cid = repo.commit_dir(_image(tmp_path / "img"), thread="nb").id
        size, chunks = 0, []
        for e in repo.get_tree(repo.get_commit(cid).tree):
            if e.name == "pages.img":
                size, chunks = repo.get_blob_chunks(e.id)
        loc = repo.index.lookup(chunks[len(chunks) // 2])
        assert size and loc is not None
        path = tmp_path / "store" / "packs" / loc.pack[:2] / loc.pack
        data = bytearray(path.read_bytes())
        data[loc.offset + loc.length // 2] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatch, match=chunks[len(chunks) // 2].hex()):
            checkout_dir(repo, cid, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        report = check(repo, read_data=True)
        assert any(chunks[len(chunks) // 2].hex() in p for p in report.problems)
    finally:
        repo.close()


def _pages_chunks(repo: Repository, cid: str) -> list[bytes]:
    for e in repo.get_tree(repo.get_commit(cid).tree):
        if e.name == "pages.img":
            return repo.get_blob_chunks(e.id)[1]
    raise AssertionError("no pages.img")


def test_moved_or_resized_chunks_are_refused_on_checkout(tmp_path: Path) -> None:
    """Checkout and single reads do not hash an encrypted store's chunks again: the tags
    must refuse an index entry pointed at another object's sealed bytes, and the length
    check a raw length changed in the index (it is not sealed)."""
    creds = _creds(tmp_path)
    with Repository.init(tmp_path / "store", pack_size=1 << 20, encrypt=creds,
                         kdf=FAST) as repo:
        cid = repo.commit_dir(_image(tmp_path / "img"), thread="nb").id
        a, b = _pages_chunks(repo, cid)[1:3]
    db = sqlite3.connect(tmp_path / "store" / "index.sqlite")
    cols = "pid, offset, length, raw_length"
    row_a = db.execute(f"SELECT {cols} FROM objects WHERE id = ?", (a,)).fetchone()
    row_b = db.execute(f"SELECT {cols} FROM objects WHERE id = ?", (b,)).fetchone()
    assert row_a != row_b
    edits = (("swapped", (row_b, row_a), "does not authenticate"),  # a <-> b
             ("resized", ((*row_a[:3], row_a[3] + 4096), row_b), "bytes, not"))
    try:
        for what, (new_a, new_b), error in edits:
            for oid, row in ((a, new_a), (b, new_b)):
                db.execute("UPDATE objects SET pid = ?, offset = ?, length = ?, "
                           "raw_length = ? WHERE id = ?", (*row, oid))
            db.commit()
            with Repository.open(tmp_path / "store", credentials=creds) as repo:
                with pytest.raises(ChecksumMismatch, match=error) as got:
                    checkout_dir(repo, cid, tmp_path / "out")
                assert a.hex() in str(got.value) or b.hex() in str(got.value), what
                assert not (tmp_path / "out").exists()
                with pytest.raises(ChecksumMismatch, match=a.hex()):  # one object's read
                    repo.read_object(a)  # (a restore serving pages from the store)
        for oid, row in ((a, row_a), (b, row_b)):  # put back: the checkout is right again
            db.execute("UPDATE objects SET pid = ?, offset = ?, length = ?, raw_length = ? "
                       "WHERE id = ?", (*row, oid))
        db.commit()
    finally:
        db.close()
    with Repository.open(tmp_path / "store", credentials=creds) as repo:
        checkout_dir(repo, cid, tmp_path / "out")
    assert (tmp_path / "out" / "pages.img").read_bytes() == \
        (tmp_path / "img" / "pages.img").read_bytes()


def test_a_key_holders_wrong_seal_is_found_by_check_not_by_checkout(tmp_path: Path) -> None:
    """The limit of checking by the tags alone (docs/store.md): a payload sealed under the
    wrong id by a key holder (a writer's bug) opens, so checkout restores it; ``check
    --read-data``, which hashes every plaintext again, names the object."""
    creds = _creds(tmp_path)
    with Repository.init(tmp_path / "store", pack_size=1 << 20, encrypt=creds,
                         kdf=FAST) as repo:
        cid = repo.commit_dir(_image(tmp_path / "img"), thread="nb").id
        victim = _pages_chunks(repo, cid)[1]
        loc = repo.index.lookup(victim)
        assert loc is not None and loc.compression != DELTA
        path = tmp_path / "store" / "packs" / loc.pack[:2] / loc.pack
        data = bytearray(path.read_bytes())
        sealed = bytes(data[loc.offset:loc.offset + loc.length])
        payload = bytearray(repo.key.open(victim, loc.type, loc.compression, sealed))
        assert loc.compression == 0  # random pages are stored raw
        payload[100] ^= 0xFF  # the wrong plaintext, sealed as if it were the victim's
        data[loc.offset:loc.offset + loc.length] = repo.key.seal(
            victim, loc.type, loc.compression, bytes(payload))
        path.write_bytes(bytes(data))
        checkout_dir(repo, cid, tmp_path / "out")
        got = (tmp_path / "out" / "pages.img").read_bytes()
        want = (tmp_path / "img" / "pages.img").read_bytes()
        diff = [i for i in range(len(want)) if got[i] != want[i]]
        assert len(got) == len(want) and len(diff) == 1
        report = check(repo, read_data=True)
        assert [p for p in report.problems if victim.hex() in p and "checksum" in p]


def test_gc_check_and_rebuild_on_an_encrypted_store(tmp_path: Path) -> None:
    creds = _creds(tmp_path)
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20, encrypt=creds, kdf=FAST)
    try:
        snaps = _fill(repo, _image(tmp_path / "img"))
        other = repo.commit_dir(_image(tmp_path / "img2"), thread="other").id
        assert check(repo, read_data=True).problems == []
        repo.delete_thread(f"nb/{SECRET}")
        report = gc(repo)
        assert sorted(report.commits_removed) == sorted(c for c, _ in snaps)
        assert report.packs_deleted or report.packs_repacked
        after = check(repo, read_data=True)
        assert after.problems == [] and after.commits == 1
        checkout_dir(repo, other, tmp_path / "out")
        assert (tmp_path / "out" / "pages.img").read_bytes() == \
            (tmp_path / "img2" / "pages.img").read_bytes()
    finally:
        repo.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(tmp_path / "store" / "index.sqlite") + suffix).unlink(missing_ok=True)
    with Repository.open(tmp_path / "store", credentials=creds) as repo:  # index rebuilt
        assert [c.id for c in repo.find_commits(token=SECRET)] == []
        assert repo.index.commit_ids() == [other]
        assert check(repo, read_data=True).problems == []


def test_push_and_pull_are_refused_with_the_reason(tmp_path: Path) -> None:
    with Repository.init(tmp_path / "store", encrypt=_creds(tmp_path), kdf=FAST) as repo:
        repo.commit_dir(_image(tmp_path / "img"), thread="nb")
        for fn, args in ((push, ()), (pull, ("nb",))):
            with pytest.raises(RemoteError, match="encrypted local store"):
                fn(repo, "s3://nowhere/x", *args)


def test_the_command_line_makes_and_opens_an_encrypted_store(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("cli password\n")
    store = str(tmp_path / "store")

    def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        e = subprocess_env(**env)
        e.pop("INFINIJUP_STORE_PASSWORD_FILE", None)
        e.pop("INFINIJUP_STORE_KEY_FILE", None)
        e.update(env)
        return subprocess.run([sys.executable, "-m", "infinijup.store", "--store", store,
                               *args], capture_output=True, text=True, env=e, timeout=120)

    made = cli("init", "--encrypt", "--password-file", str(pw))
    assert made.returncode == 0, made.stderr
    with Repository.open(store, credentials=Credentials.build(password_file=pw)) as repo:
        assert repo.config.encrypted and repo.config.version == 3
        cid = repo.commit_dir(_image(tmp_path / "img"), thread="nb").id
    ok = cli("threads", INFINIJUP_STORE_PASSWORD_FILE=str(pw))
    assert ok.returncode == 0 and cid[:12] in ok.stdout, ok.stderr
    none = cli("threads")
    assert none.returncode == 2 and "[store_wrong_key]" in none.stderr
    (tmp_path / "wrong").write_text("not it\n")
    wrong = cli("log", INFINIJUP_STORE_PASSWORD_FILE=str(tmp_path / "wrong"))
    assert wrong.returncode == 2 and "no key slot" in wrong.stderr
    listed = cli("key", "list", store, INFINIJUP_STORE_PASSWORD_FILE=str(pw))
    assert listed.returncode == 0 and "password" in listed.stdout, listed.stderr


# -- a real process through an encrypted store ----------------------------------------------

CRIU = os.environ.get("INFINIJUP_CRIU", "/opt/infinijup/criu/sbin/criu")
HOLDER = """
import os, signal, sys, time
secret = sys.argv[1]
held = [(secret + "|").encode() * 50000 for _ in range(4)]  # the secret in memory, 4 x 2 MB
filler = os.urandom(16 << 20)
def answer(*_):
    ok = all(h == (secret + "|").encode() * 50000 for h in held)
    print("alive", ok, len(filler), flush=True)
signal.signal(signal.SIGUSR1, answer)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _lines(path: Path, want: str, proc_alive: object) -> list[str]:
    """The lines of ``path`` once one equals ``want`` (waits for the event, not a delay)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines()
        if want in lines:
            return lines
        assert callable(proc_alive) and proc_alive(), f"the process ended: {lines}"
        time.sleep(0.05)
    raise AssertionError(f"{want!r} never came: {path.read_text()!r}")


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(CRIU, os.X_OK),
                    reason="needs root and CRIU (make criu) to dump a real process")
def test_a_real_process_dumped_into_an_encrypted_store_and_restored(tmp_path: Path) -> None:
    out = tmp_path / "holder.out"
    with open(out, "w") as f:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, SECRET], stdout=f,
                             stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    pid = p.pid
    try:
        _lines(out, "ready", lambda: p.poll() is None)
        (tmp_path / "dump").mkdir()
        r = subprocess.run([CRIU, "dump", "-t", str(pid), "-D", str(tmp_path / "dump"),
                            "--shell-job", "-o", "dump.log"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (tmp_path / "dump" / "dump.log").read_text()[-2000:]
        assert p.wait(timeout=30) is not None  # CRIU's dump ended it (no --leave-running)
        (tmp_path / "dump" / "dump.log").unlink()
        pages = next((tmp_path / "dump").glob("pages-*.img"))
        assert SECRET.encode() in pages.read_bytes()  # the control: the image holds it

        creds = _creds(tmp_path)
        with Repository.init(tmp_path / "store", encrypt=creds, kdf=FAST) as repo:
            cid = repo.commit_dir(tmp_path / "dump", thread=f"nb/{SECRET}").id
        needles = {"secret": SECRET.encode(),
                   "blake3(pages)": blake3.blake3(pages.read_bytes()).digest()}
        needles["blake3(pages) hex"] = needles["blake3(pages)"].hex().encode()
        assert _scan(tmp_path / "store", needles) == set()

        with Repository.open(tmp_path / "store", credentials=creds) as repo:
            checkout_dir(repo, cid, tmp_path / "restore")
        diff = subprocess.run(["diff", "-r", str(tmp_path / "dump"), str(tmp_path / "restore")],
                              capture_output=True, text=True)
        assert diff.returncode == 0, diff.stdout[:500]
        r = subprocess.run([CRIU, "restore", "-D", str(tmp_path / "restore"), "--shell-job",
                            "--restore-detached", "-o", "restore.log"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (tmp_path / "restore" / "restore.log").read_text()[-2000:]
        os.kill(pid, signal.SIGUSR1)  # the restored process answers with what it holds
        lines = _lines(out, f"alive True {16 << 20}", lambda: _alive(pid))
        assert lines[0] == "ready"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
