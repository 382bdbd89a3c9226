"""Tiers as a policy: what leaves the local store once a remote holds it, and getting it back.

The tiers are the hot tier (recent images in the helper's work dir, engine/hot_tier.py), the
local store, and a remote (remote.py). With a local budget, ``evict`` makes commits that are
safely on the remote *remote-only* (remote_only.py): their chunks leave the local store,
their commit files, trees and blobs stay. ``ensure_local`` pulls such a commit's chunks back
(verified) before its images are read.

Eviction, under the store's exclusive lock (taken only when no snapshot is being written:
it gives up after ``lock_timeout`` and the caller tries again later):

plan
    the store's pack bytes are over ``budget``. Candidates are local commits that are safely
    on the remote (its commit object, its manifest and every pack the manifest names are
    there, a pack of the same name here having the same size) and not *pinned* (being
    restored now); oldest first, the *preferred* ones (thread tips, running kernels' heads,
    hibernated kernels' snapshots) last. An object stays while any local commit needs it (its
    blobs' chunks and, transitively, their page-delta sources); every tree and blob stays.
    Commits are taken until the store would be under the budget, counting packs as gc
    leaves them (deleted when nothing in them is needed, repacked when 10 % or more is not).
execute
    the record first (a crash after it leaves commits marked whose chunks are still here:
    harmless, a restore pulls nothing), then gc's repack-and-delete of the packs
    (``gc.drop_unused``). A commit that was never pushed is never a candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from .errors import ObjectMissing, StoreError, StoreLocked
from .gc import REPACK_UNUSED, drop_unused
from .keys import Credentials
from .lock import FileLock
from .objects import Commit
from .packs import DELTA
from .reader import ObjectReader
from .remote import PullProgress, PullReport, fetch_commit_data, refuse_encrypted_store
from .remote_only import mark_remote_only, remote_only
from .remote_repo import RemoteRepo, open_remote
from .repository import Repository


@dataclass(frozen=True)
class EvictionReport:
    """What an eviction pass did."""

    budget: int
    bytes_before: int
    bytes_after: int
    commits: list[str] = field(default_factory=list)  # made remote-only, oldest first
    packs_deleted: int = 0
    packs_repacked: int = 0
    note: str = ""  # why it did less than asked ("" when the store is under budget)

    def to_json(self) -> dict:
        return {"budget": self.budget, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "commits": list(self.commits),
                "packs_deleted": self.packs_deleted, "packs_repacked": self.packs_repacked,
                "note": self.note}


def store_bytes(repo: Repository) -> int:
    """The bytes of the store's packs (what the local budget counts)."""
    return sum(size for size, _count in repo.index.packs().values())


def safely_remote(repo: Repository, remote: RemoteRepo,
                  manifests: dict[str, list[str]] | None = None) -> set[str]:
    """Local commits (not remote-only yet) whose every object the remote holds.
    ``manifests`` caches the remote's manifests between calls (they never change)."""
    cache = manifests if manifests is not None else {}
    elsewhere = remote_only(repo)
    there = remote.commits_present(c for c in repo.index.commit_ids() if c not in elsewhere)
    for cid in there - set(cache):
        cache[cid] = remote.get_manifest(cid)
    packs_there = remote.present_packs(set().union(*(cache[c] for c in there)))
    local_packs = repo.index.packs()
    return {cid for cid in there
            if all(p in packs_there and (p not in local_packs or
                                         remote.remote_size(local_packs[p][0]) == packs_there[p])
                   for p in cache[cid])}


def evict(repo: Repository, remote: RemoteRepo | str, budget: int, *,
          pinned: Collection[str] = (), preferred: Collection[str] = (), lock_timeout: float = 1.0,
          manifests: dict[str, list[str]] | None = None) -> EvictionReport:
    """Make commits safely on ``remote`` (opened, or a URL opened with the environment's
    credentials, keys.py) remote-only until the store's packs fit in ``budget``
    bytes (see the module docs). Raises StoreLocked when a snapshot kept the store busy for
    ``lock_timeout`` seconds."""
    before = store_bytes(repo)
    if before <= budget:
        return EvictionReport(budget, before, before)
    refuse_encrypted_store(repo, "eviction to a remote")
    remote = remote if isinstance(remote, RemoteRepo) else open_remote(remote)
    url = str(remote.url)
    safe = safely_remote(repo, remote, manifests)  # remote calls before the lock
    with FileLock(repo.lock_path, timeout=lock_timeout):
        plan = _Planner(repo).plan(budget, safe - set(pinned), set(preferred))
        if not plan.commits:
            after = store_bytes(repo)
            return EvictionReport(budget, before, after, note=(
                "nothing more can leave: every commit over the budget is either not on the "
                "remote yet or being restored" if after > budget else ""))
        mark_remote_only(repo, {c: url for c in plan.commits})
        done = drop_unused(repo, plan.live)
    repo.index.truncate_journal()
    after = store_bytes(repo)
    return EvictionReport(budget, before, after, plan.commits, len(done.packs_deleted),
                          len(done.packs_repacked),
                          "" if after <= budget else "still over the budget: what is left "
                          "is needed by commits that are not on the remote yet or being "
                          "restored, or shared with them")


def ensure_local(repo: Repository, commit_id: str, *, progress: PullProgress | None = None,
                 unless: Callable[[], bool] = lambda: False,
                 creds: Credentials | None = None) -> PullReport | None:
    """Pull the chunks of ``commit_id`` back from its remote if it is remote-only (opened
    with ``creds``, default the environment's: keys.py). None when there was nothing to do:
    it is local, or ``unless()`` says its images are at hand elsewhere (the hot tier)."""
    # the shared lock waits out an eviction that may be removing this commit's packs
    with FileLock(repo.lock_path, shared=True, timeout=repo.lock_timeout):
        url = remote_only(repo).get(commit_id)
    if url is None or unless():
        return None
    return fetch_commit_data(repo, url, commit_id, progress, creds=creds)


@dataclass
class _Plan:
    commits: list[str]
    live: set[bytes]


class _Planner:
    """Which commits to make remote-only, from reference counts of their chunks."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self._trees: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self._blobs: dict[str, frozenset[bytes]] = {}
        self._sources: dict[bytes, list[bytes]] = {}

    def plan(self, budget: int, candidates: set[str], preferred: set[str]) -> _Plan:
        repo = self.repo
        elsewhere = remote_only(repo)
        commits: dict[str, Commit] = {cid: repo.get_commit(cid)
                                      for cid in repo.index.commit_ids()}
        meta: set[bytes] = set()  # every tree and blob: they always stay
        refs: dict[bytes, int] = {}  # chunk -> local commits needing it
        with ObjectReader(repo) as reader:
            self.reader = reader
            for cid, commit in commits.items():
                trees, blobs = self._walk(commit.tree)
                meta.update(bytes.fromhex(t) for t in trees)
                meta.update(bytes.fromhex(b) for b in blobs)
                if cid not in elsewhere:
                    for oid in self._chunks(blobs):
                        refs[oid] = refs.get(oid, 0) + 1
            packs = {name: size for name, (size, _count) in repo.index.packs().items()}
            used = dict.fromkeys(packs, 0)
            where: dict[bytes, tuple[str, int]] = {}
            for oid, loc in repo.index.iter_objects():
                if oid in meta or refs.get(oid):
                    used[loc.pack] += loc.length
                    where[oid] = (loc.pack, loc.length)
            order = sorted((c for c in commits if c in candidates and c not in elsewhere),
                           key=lambda c: (c in preferred, commits[c].created, c))
            chosen: list[str] = []
            for cid in order:
                if _size_after(packs, used) <= budget:
                    break
                chosen.append(cid)
                for oid in self._chunks(self._walk(commits[cid].tree)[1]):
                    refs[oid] -= 1
                    if refs[oid] == 0 and oid not in meta and oid in where:
                        pack, length = where[oid]
                        used[pack] -= length
        live = meta | {oid for oid, n in refs.items() if n > 0}
        return _Plan(chosen, live)

    def _walk(self, tree_id: str) -> tuple[frozenset[str], frozenset[str]]:
        """(tree ids, blob ids) under a tree, itself included."""
        got = self._trees.get(tree_id)
        if got is None:
            trees, blobs = {tree_id}, set()
            for e in self.repo.get_tree(tree_id):
                if e.kind == "dir":
                    sub_trees, sub_blobs = self._walk(e.id)
                    trees |= sub_trees
                    blobs |= sub_blobs
                elif e.kind == "file":
                    blobs.add(e.id)
            got = self._trees[tree_id] = (frozenset(trees), frozenset(blobs))
        return got

    def _chunks(self, blobs: frozenset[str]) -> set[bytes]:
        out: set[bytes] = set()
        for b in blobs:
            out |= self._blob_chunks(b)
        return out

    def _blob_chunks(self, blob_id: str) -> frozenset[bytes]:
        """A blob's chunks and, transitively, the sources of its page-delta chunks."""
        got = self._blobs.get(blob_id)
        if got is not None:
            return got
        ids = set(self.repo.get_blob_chunks(blob_id)[1])
        todo = list(ids)
        while todo:
            locs = self.repo.index.lookup_many(todo)
            if len(locs) != len(todo):
                lost = min(set(todo) - set(locs)).hex()
                raise ObjectMissing(f"eviction refused: chunk {lost} of blob {blob_id} is "
                                    "missing (run check)")
            todo = []
            for oid, loc in locs.items():
                if loc.compression != DELTA:
                    continue
                if oid not in self._sources:
                    try:
                        self._sources[oid] = self.reader.sources(oid, loc)
                    except StoreError as exc:
                        raise StoreError(f"eviction refused: {exc} (run check)") from exc
                for sid in self._sources[oid]:
                    if sid not in ids:
                        ids.add(sid)
                        todo.append(sid)
        got = self._blobs[blob_id] = frozenset(ids)
        return got


def _size_after(packs: dict[str, int], used: dict[str, int]) -> int:
    """The store's pack bytes once gc's rules are applied to ``used`` bytes per pack."""
    total = 0
    for name, size in packs.items():
        if used[name] == 0:
            continue
        total += used[name] if size - used[name] >= REPACK_UNUSED * size else size
    return total


__all__ = ["EvictionReport", "StoreLocked", "ensure_local", "evict", "safely_remote",
           "store_bytes"]
