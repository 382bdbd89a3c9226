"""Push, pull and clone a store to and from an S3 bucket (a *remote*).

Layout under ``s3://bucket/prefix/`` (remote_repo.py names and seals each object)::

    config, keys/<slot id>       an encrypted remote's id and key slots (keys.py)
    packs/<xx>/<name>            pack files, the local ones sealed (packs.py, crypto.py)
    commits/<xx>/<name>          commit objects (canonical JSON; the id is their BLAKE3)
    manifests/<xx>/<name>        JSON list of the packs holding every object of its tree
    refs/<name>                  the thread's tip commit id (and a sequence number)

``<name>`` is the keyed BLAKE3 of the pack's, commit's or thread's plaintext id on an
encrypted remote, and the plain id on an unencrypted one (which a push needs to be asked
for: ``Credentials.unencrypted``). Everything but refs is written once under a name that
depends only on its content, so only what the remote lacks moves: a push after a small
change uploads the packs of the new commit, not the image.
A push writes packs -> manifests -> commits -> refs; an interrupted push leaves only
unreferenced objects, which the next push reuses. A ref moves by compare-and-swap (S3
conditional writes: ``If-None-Match: *`` to create, ``If-Match: <etag>`` to move), and
only forward (the remote tip must be in the local history): two machines pushing one
thread never lose a commit; the loser gets a RemoteConflict naming the thread.

On an encrypted remote, every ref carries a sequence number that each move increments; a
store notes the highest it saw per remote and thread (``<store>/remote-seen``), and a ref
older than that (an old ref put back: a replay, a rollback) is refused (RemoteReplayed).

A pull downloads the packs a commit (and its history) needs into ``tmp/pull/`` and
verifies each one (authenticated, then header checksum and name, every stored object's BLAKE3, page deltas
rebuilt from their sources, every chunk of every tree present) before anything becomes
visible: packs are renamed into ``packs/`` and indexed, then commit files, then the
thread. A pull killed midway leaves the store as it was plus verified packs in
``tmp/pull/``, which the retry keeps. A damaged remote pack is refused and nothing of
that pull is restored.

A *remote-only* commit (its chunks evicted from the local store, tiers.py) comes back with
``fetch_commit_data`` (and ``pull`` of its id or thread): the packs its manifest names that the
store lacks are downloaded and verified the same way, then the commit is local again.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from . import delta, fsutil
from .errors import (
    ChecksumMismatch,
    CorruptObject,
    CorruptPack,
    ObjectMissing,
    RemoteConflict,
    RemoteCorrupt,
    RemoteError,
    RemoteNotFound,
    RemoteReplayed,
    StoreError,
    UnknownRef,
)
from .faults import holdpoint
from .keys import Credentials
from .lock import FileLock
from .objects import Commit, decode_blob, decode_commit, decode_tree, hash_bytes, is_hex_id
from .packs import DELTA, PackEntry, decode_payload, pack_path, read_pack_header
from .reader import ObjectReader
from .remote_only import mark_local, remote_only
from .remote_repo import RemoteRef, RemoteRepo, open_remote
from .repository import Repository
from .s3 import PreconditionFailed, S3Bucket

#: A remote as the functions here take it: opened, or a URL opened with ``creds`` (default:
#: the environment's, keys.py).
Remote = RemoteRepo | str
SEEN = "remote-seen"

#: ``progress(packs_done, packs_total, bytes_done)``, called after each downloaded pack.
PullProgress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class PushReport:
    """What a push moved."""

    packs_uploaded: int = 0
    bytes_uploaded: int = 0
    packs_present: int = 0  # needed packs the remote had already
    commits_uploaded: int = 0
    threads: dict[str, str] = field(default_factory=dict)  # thread -> tip on the remote


@dataclass(frozen=True)
class PullReport:
    """What a pull moved."""

    commit: str
    packs_downloaded: int = 0
    bytes_downloaded: int = 0
    packs_resumed: int = 0  # verified by an interrupted pull and kept
    commits_fetched: int = 0
    thread: str | None = None  # the local thread moved to ``commit``


# -- remotes and refs ------------------------------------------------------------------------

def refuse_encrypted_store(repo: Repository, what: str) -> None:
    """An encrypted local store neither pushes nor pulls (yet): its packs are sealed with
    its own key and its ids are keyed, while a remote's packs are a plain store's packs
    verbatim, so a transfer would have to re-pack every chunk (decrypt, re-hash, re-seal)."""
    if repo.key is not None:
        raise RemoteError(
            f"{what} refused: {repo.path} is an encrypted local store, whose packs and ids "
            "cannot be sent to or taken from a remote as they are (a transfer would re-pack "
            "every chunk; not built). Push from, or pull into, a plain store, or keep the "
            "encrypted store on its disk only")


def _opened(remote: Remote | S3Bucket, creds: Credentials | None = None) -> RemoteRepo:
    if isinstance(remote, RemoteRepo):
        return remote
    return open_remote(str(remote.url) if isinstance(remote, S3Bucket) else remote, creds)


def read_remote_ref(remote: Remote | S3Bucket, thread: str) -> tuple[str | None, str | None]:
    """(tip, ETag) of ``thread`` on the remote; (None, None) when it does not exist."""
    ref = _opened(remote).read_ref(thread)
    return ref.tip, ref.etag


def remote_threads(remote: Remote | S3Bucket) -> list[str]:
    """Every thread name on the remote."""
    return _opened(remote).threads()


def read_manifest(remote: Remote, commit_id: str) -> list[str]:
    """The packs holding every object of ``commit_id``'s tree on the remote (RemoteCorrupt
    when the list is missing or damaged)."""
    return _opened(remote).get_manifest(commit_id)


def _seen(repo: Repository) -> dict:
    try:
        obj = json.loads((repo.path / SEEN).read_bytes())
        return obj["remotes"] if obj.get("version") == 1 else {}
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # damaged: replays are then caught from the next ref seen on


def _check_seen(repo: Repository, remote: RemoteRepo, thread: str, ref: RemoteRef) -> None:
    """Refuse a ref older than one this store saw on this remote (RemoteReplayed)."""
    if not remote.encrypted:
        return
    seen = _seen(repo).get(remote.id, {}).get(thread)
    if seen is None:
        return
    seq, tip = seen
    if ref.tip is None or ref.seq < seq or (ref.seq == seq and ref.tip != tip):
        now = (f"at {ref.tip[:12]} (move {ref.seq})" if ref.tip else "gone")
        raise RemoteReplayed(
            f"thread {thread!r} on {remote.url} is {now}, but this store saw it at "
            f"{tip[:12]} (move {seq}): an old ref was put back (replayed or rolled back); "
            "refused, nothing changed")


def _note_seen(repo: Repository, remote: RemoteRepo, thread: str, seq: int, tip: str) -> None:
    if not remote.encrypted:
        return
    with FileLock(repo.refs_lock_path, timeout=repo.lock_timeout):
        seen = _seen(repo)
        old = seen.get(remote.id, {}).get(thread)
        if old is not None and old[0] >= seq:
            return
        seen.setdefault(remote.id, {})[thread] = [seq, tip]
        body = json.dumps({"version": 1, "remotes": seen}, sort_keys=True).encode() + b"\n"
        fsutil.atomic_write(repo.path / SEEN, body, tmp_dir=repo.tmp_dir)


# -- push ----------------------------------------------------------------------------------

def push(repo: Repository, remote: Remote, threads: Iterable[str] = (), *,
         creds: Credentials | None = None) -> PushReport:
    """Send ``threads`` (default: every local thread) and what they need to ``remote``
    (refused for an unencrypted remote unless ``creds.unencrypted``)."""
    refuse_encrypted_store(repo, "push")
    remote = _opened(remote, creds)
    remote.check_push_allowed()
    local = repo.threads()
    names = list(threads) or sorted(local)
    for name in names:
        if name not in local:
            raise UnknownRef(f"no thread {name!r} in {repo.path}")
    with FileLock(repo.lock_path, shared=True, timeout=repo.lock_timeout):
        refs = {n: remote.read_ref(n) for n in names}
        for n in names:
            _check_seen(repo, remote, n, refs[n])
        todo = [n for n in names if refs[n].tip != local[n]]
        for n in todo:
            there = refs[n].tip
            if there is not None and there not in _ancestors(repo, local[n]):
                raise RemoteConflict(
                    f"thread {n!r} on {remote.url} is at {there[:12]}, which is not in the "
                    f"local history of {local[n][:12]}: pull it first, or push another thread")
        on_remote = remote.commits_present(repo.index.commit_ids())
        commits = _commits_to_push(repo, [local[n] for n in todo], on_remote)
        elsewhere = remote_only(repo)
        for c in commits:
            if c.id in elsewhere:
                raise RemoteError(f"commit {c.id[:12]} is remote-only here (its data is on "
                                  f"{elsewhere[c.id]}): `infinijup store pull "
                                  f"{elsewhere[c.id]} {c.id}` first, then push")
        manifests = {c.id: _packs_of(repo, c.tree) for c in commits}
        needed = set().union(*manifests.values()) if manifests else set()
        have = set(remote.present_packs(needed))
        sent = sent_bytes = 0
        for pack in sorted(needed - have):
            sent_bytes += remote.upload_pack(pack, pack_path(repo.packs_dir, pack))
            sent += 1
            holdpoint("remote_push_after_pack")
        for c in commits:  # parents first: a commit on the remote has its history there
            remote.put_manifest(c.id, manifests[c.id])
            remote.put_commit(c.id, _commit_body(repo, c.id))
        holdpoint("remote_push_before_ref")
        for n in todo:
            _move_remote_ref(repo, remote, n, local[n], refs[n])
    return PushReport(sent, sent_bytes, len(needed & have), len(commits),
                      {n: local[n] for n in names})


def _move_remote_ref(repo: Repository, remote: RemoteRepo, thread: str, tip: str,
                     ref: RemoteRef) -> None:
    try:
        remote.write_ref(thread, tip, ref.seq + 1, ref.etag)
    except PreconditionFailed:
        again = remote.read_ref(thread)
        now = again.tip
        if now == tip:
            _note_seen(repo, remote, thread, again.seq, tip)
            return
        raise RemoteConflict(
            f"thread {thread!r} on {remote.url} was moved by another writer (now at "
            f"{now[:12] if now else 'nothing'}); your commits were uploaded but the thread "
            "was left alone: pull it, or push another thread") from None
    _note_seen(repo, remote, thread, ref.seq + 1, tip)


def _ancestors(repo: Repository, tip: str) -> set[str]:
    return {c.id for c in _history(repo, [tip], set())}


def _history(repo: Repository, tips: list[str], stop: set[str]) -> list[Commit]:
    """Commits reachable from ``tips`` without passing ``stop``, parents before children."""
    order: list[Commit] = []
    seen: set[str] = set()
    stack: list[tuple[str, Commit | None]] = [(t, None) for t in tips]
    while stack:
        cid, done = stack.pop()
        if done is not None:
            order.append(done)
            continue
        if cid in seen or cid in stop:
            continue
        seen.add(cid)
        commit = repo.get_commit(cid)
        stack.append((cid, commit))
        stack.extend((p, None) for p in commit.parents)
    return order


def _commits_to_push(repo: Repository, tips: list[str], on_remote: set[str]) -> list[Commit]:
    return _history(repo, tips, on_remote)


def _commit_body(repo: Repository, cid: str) -> bytes:
    body = (repo.commits_dir / cid[:2] / cid).read_bytes()
    if hash_bytes(body).hex() != cid:
        raise ChecksumMismatch(f"commit {cid}: checksum mismatch (run check)")
    return body


def _packs_of(repo: Repository, tree_id: str) -> list[str]:
    """The local packs holding every object of ``tree_id`` (delta sources included)."""
    ids: set[bytes] = set()
    _walk_tree(tree_id, ids, repo.read_object)
    packs: set[str] = set()
    todo = list(ids)
    with ObjectReader(repo) as reader:
        while todo:
            locs = repo.index.lookup_many(todo)
            if len(locs) != len(todo):
                lost = min(set(todo) - set(locs)).hex()
                raise ObjectMissing(f"object {lost} is not in the local store (run check)")
            todo = []
            for oid, loc in locs.items():
                packs.add(loc.pack)
                if loc.compression == DELTA:
                    for sid in reader.sources(oid, loc):
                        if sid not in ids:
                            ids.add(sid)
                            todo.append(sid)
    return sorted(packs)


def _walk_tree(tree_id: str, ids: set[bytes], read: Callable[[bytes], bytes]) -> None:
    """Add the ids of a tree and everything under it (trees, blobs, chunks) to ``ids``;
    ``read(oid)`` returns an object's verified plaintext."""
    stack = [tree_id]
    while stack:
        tid = stack.pop()
        oid = bytes.fromhex(tid)
        if oid in ids:
            continue
        ids.add(oid)
        for e in decode_tree(read(oid)):
            if e.kind == "dir":
                stack.append(e.id)
            elif e.kind == "file":
                bid = bytes.fromhex(e.id)
                if bid not in ids:
                    ids.add(bid)
                    ids.update(decode_blob(read(bid))[1])


# -- pull ----------------------------------------------------------------------------------

def pull(repo: Repository, remote: Remote, ref: str, *,
         creds: Credentials | None = None) -> PullReport:
    """Fetch ``ref`` (a thread of the remote, or a full commit id) and its history; a
    thread is created or moved forward locally (RemoteConflict if the two diverged)."""
    refuse_encrypted_store(repo, "pull")
    remote = _opened(remote, creds)
    remote_ref = None
    if is_hex_id(ref):
        tip, thread = ref, None
    else:
        remote_ref = remote.read_ref(ref)
        _check_seen(repo, remote, ref, remote_ref)
        if remote_ref.tip is None:
            raise RemoteNotFound(f"no thread {ref!r} on {remote.url}")
        tip, thread = remote_ref.tip, ref
    with FileLock(repo.lock_path, shared=True, timeout=repo.lock_timeout):
        commits = _fetch_commits(repo, remote, tip)
        needed: set[str] = set()
        for cid, _c, _body in commits:
            needed.update(remote.get_manifest(cid))
        needed -= set(repo.index.packs())
        staging = _Staging(repo)
        with FileLock(staging.dir / "lock", timeout=repo.lock_timeout):
            counts = staging.fetch(remote, sorted(needed))
            entries = staging.verify(sorted(needed), [c for _, c, _ in commits])
            _install(repo, staging, entries, commits)
            staging.clear(needed)
    if tip in remote_only(repo):  # known here, its chunks evicted: bring them back too
        more = fetch_commit_data(repo, remote, tip)
        counts = (counts[0] + more.packs_downloaded, counts[1] + more.bytes_downloaded,
                  counts[2] + more.packs_resumed)
    moved = _advance_thread(repo, thread, tip, str(remote.url)) if thread else None
    if thread and remote_ref is not None:
        _note_seen(repo, remote, thread, remote_ref.seq, tip)
    return PullReport(tip, counts[0], counts[1], counts[2], len(commits), moved)


def fetch_commit_data(repo: Repository, remote: Remote, commit_id: str,
                      progress: PullProgress | None = None, *,
                      creds: Credentials | None = None) -> PullReport:
    """Bring back the chunks of a commit this store knows (a remote-only one, tiers.py) from
    ``url``: the packs its manifest names that the store lacks, verified as a pull's (every
    object of the commit's tree present and hashing to its id) before they become visible;
    then the commit is no longer remote-only."""
    refuse_encrypted_store(repo, "fetching a commit's data")
    commit = repo.get_commit(commit_id)
    remote = _opened(remote, creds)
    with FileLock(repo.lock_path, shared=True, timeout=repo.lock_timeout):
        needed = set(remote.get_manifest(commit.id)) - set(repo.index.packs())
        staging = _Staging(repo)
        with FileLock(staging.dir / "lock", timeout=repo.lock_timeout):
            counts = staging.fetch(remote, sorted(needed), progress)
            entries = staging.verify(sorted(needed), [commit])
            _install(repo, staging, entries, [])
            staging.clear(needed)
        mark_local(repo, [commit.id])
    return PullReport(commit.id, counts[0], counts[1], counts[2], 0, None)


def clone(remote: Remote, path: str | os.PathLike[str], *,
          creds: Credentials | None = None) -> tuple[Repository, list[PullReport]]:
    """Create a store at ``path`` (or open the one there: an interrupted clone resumes) and
    pull every thread of ``remote`` into it."""
    remote = _opened(remote, creds)
    names = remote.threads()
    if not names:
        raise RemoteNotFound(f"no threads on {remote.url}: nothing to clone")
    repo = Repository.open_or_init(path)
    try:
        return repo, [pull(repo, remote, n) for n in names]
    except BaseException:
        repo.close()
        raise


def _fetch_commits(repo: Repository, remote: RemoteRepo, tip: str
                   ) -> list[tuple[str, Commit, bytes]]:
    """The commits of ``tip``'s history that the store lacks, verified, parents first."""
    order: list[tuple[str, Commit, bytes]] = []
    seen: set[str] = set()
    stack: list[tuple[str, tuple[str, Commit, bytes] | None]] = [(tip, None)]
    while stack:
        cid, done = stack.pop()
        if done is not None:
            order.append(done)
            continue
        if cid in seen or repo.index.has_commit(cid):
            continue
        seen.add(cid)
        body = remote.get_commit(cid)
        if body is None:
            if cid == tip:
                raise RemoteNotFound(f"no commit {cid} on {remote.url}")
            raise RemoteCorrupt(f"commit {cid} (in the history of {tip[:12]}) is missing "
                                f"on {remote.url}")
        if hash_bytes(body).hex() != cid:
            raise RemoteCorrupt(f"commit {cid} on {remote.url} is damaged (checksum)")
        try:
            commit = decode_commit(cid, body)
        except CorruptObject as exc:
            raise RemoteCorrupt(f"commit {cid} on {remote.url} is damaged ({exc})") from None
        stack.append((cid, (cid, commit, body)))
        stack.extend((p, None) for p in commit.parents)
    return order


class _Staging:
    """``tmp/pull/``: packs downloaded and verified, not yet in the store.

    ``<pack id>`` files are complete and verified (kept across interrupted pulls);
    anything else there is an unfinished download, removed by the next pull."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.dir = repo.tmp_dir / "pull"
        fsutil.make_private_dir(self.dir)

    def path(self, pack: str) -> Path:
        return self.dir / pack

    def fetch(self, remote: RemoteRepo, packs: list[str], progress: PullProgress | None = None
              ) -> tuple[int, int, int]:
        """Download and verify every pack not staged yet: (downloaded, bytes, resumed)."""
        for leftover in self.dir.iterdir():
            if leftover.name != "lock" and not is_hex_id(leftover.name):
                leftover.unlink(missing_ok=True)
        got = got_bytes = resumed = 0
        for pack in packs:
            final = self.path(pack)
            if final.exists():
                resumed += 1
                if progress is not None:
                    progress(got + resumed, len(packs), got_bytes)
                continue
            part = self.dir / f"{pack}.part"
            try:
                remote.download_pack(pack, part)
            except RemoteCorrupt:
                part.unlink(missing_ok=True)
                raise
            os.chmod(part, fsutil.FILE_MODE)
            try:
                _verify_pack(part, pack)
            except (CorruptPack, ChecksumMismatch, ObjectMissing) as exc:
                part.unlink(missing_ok=True)
                raise RemoteCorrupt(f"pack {pack} on {remote.url} is damaged ({exc}); "
                                    "nothing was restored") from None
            size = part.stat().st_size
            with open(part, "rb") as f:
                os.fsync(f.fileno())
            os.replace(part, final)
            fsutil.fsync_dir(self.dir)
            got, got_bytes = got + 1, got_bytes + size
            if progress is not None:
                progress(got + resumed, len(packs), got_bytes)
            holdpoint("remote_pull_after_pack")
        return got, got_bytes, resumed

    def verify(self, packs: list[str], commits: list[Commit]) -> dict[str, list[PackEntry]]:
        """Rebuild and check every staged page delta, and check that every object of
        ``commits`` is staged or local. Returns the staged packs' entries."""
        entries: dict[str, list[PackEntry]] = {}
        where: dict[bytes, tuple[int, PackEntry]] = {}
        fds: list[int] = []
        try:
            for pack in packs:
                entries[pack] = read_pack_header(self.path(pack))[1]
                fds.append(os.open(self.path(pack), os.O_RDONLY | os.O_CLOEXEC))
                for e in entries[pack]:
                    where.setdefault(e.id, (fds[-1], e))
            dctx = zstandard.ZstdDecompressor()

            @functools.lru_cache(maxsize=256)
            def plain(oid: bytes) -> bytes:
                if oid not in where:
                    return self.repo.read_object(oid)
                fd, e = where[oid]
                payload = os.pread(fd, e.length, e.offset)
                name = f"object {oid.hex()} of a remote pack"
                if e.compression != DELTA:
                    return decode_payload(payload, oid, e.compression, e.raw_length, name)
                try:
                    data = bytes(delta.apply(payload, e.raw_length, plain, dctx))
                except CorruptObject as exc:
                    raise ChecksumMismatch(f"{name}: damaged delta ({exc})") from None
                if hash_bytes(data) != oid:
                    raise ChecksumMismatch(f"{name}: checksum mismatch")
                return data

            try:
                for oid, (_fd, e) in where.items():
                    if e.compression == DELTA:
                        plain(oid)
                ids: set[bytes] = set()
                for c in commits:
                    _walk_tree(c.tree, ids, plain)
                absent = [i for i in ids if i not in where]
                missing = set(absent) - self.repo.index.known(absent)
            except (StoreError, RecursionError) as exc:
                self.clear(set(packs))
                raise RemoteCorrupt(f"a pack fetched from the remote does not verify "
                                    f"({exc}); nothing was restored") from None
            if missing:
                raise RemoteCorrupt(f"object {min(missing).hex()} that the pulled commits "
                                    "need is in no pack on the remote; nothing was restored")
            return entries
        finally:
            for fd in fds:
                os.close(fd)

    def clear(self, packs: set[str]) -> None:
        """Forget staged copies of ``packs``."""
        for pack in packs:
            self.path(pack).unlink(missing_ok=True)


def _verify_pack(path: Path, name: str) -> None:
    """Check a downloaded pack: its name is its header's hash, and every object stored
    whole or compressed hashes to its id (page deltas are checked once all are staged)."""
    header, entries = read_pack_header(path)
    if hash_bytes(header).hex() != name:
        raise CorruptPack(f"pack {name}: name does not match its header")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for e in entries:
            if e.compression != DELTA:
                decode_payload(os.pread(fd, e.length, e.offset), e.id, e.compression,
                               e.raw_length, f"object {e.id.hex()} in pack {name}")
    finally:
        os.close(fd)


def _install(repo: Repository, staging: _Staging, entries: dict[str, list[PackEntry]],
             commits: list[tuple[str, Commit, bytes]]) -> None:
    """Make verified packs, then commits, visible (the store's write order)."""
    sized = []
    for pack, pack_entries in entries.items():
        dst = pack_path(repo.packs_dir, pack)
        fsutil.make_private_dir(dst.parent)
        os.replace(staging.path(pack), dst)
        fsutil.fsync_dir(dst.parent)
        sized.append((pack, dst.stat().st_size, pack_entries))
    if sized:
        repo.index.add_packs(sized)
    for cid, _c, body in commits:
        fsutil.atomic_write(repo.commits_dir / cid[:2] / cid, body, tmp_dir=repo.tmp_dir)
    if commits:
        repo.index.add_commits([(c, body) for _, c, body in commits])


def _advance_thread(repo: Repository, thread: str, tip: str, where: str) -> str | None:
    here = repo.threads().get(thread)
    if here == tip:
        return thread
    if here is not None and here not in _ancestors(repo, tip):
        raise RemoteConflict(
            f"thread {thread!r} has diverged: here at {here[:12]}, on {where} at {tip[:12]}; "
            "the remote commit was fetched (use its id) but the thread was left alone")
    repo.set_thread(thread, tip, expected=here)
    return thread


__all__ = ["PullProgress", "PullReport", "PushReport", "Remote", "clone", "fetch_commit_data",
           "open_remote", "pull", "push", "read_manifest", "read_remote_ref", "remote_threads"]
