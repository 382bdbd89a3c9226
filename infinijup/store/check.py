"""``check(repo)``: verify a store end to end (rebuild.py rebuilds its index).

check walks refs -> commits -> trees -> blobs -> chunks (-> the sources of page-delta
chunks) and compares the index with every pack header. With ``read_data`` it also reads
every object of every pack and re-hashes it (a delta is rebuilt from its sources first).
Damage is reported as *problems* (``ok`` is False), each naming the object and the pack.
Harmless leftovers of interrupted writes (unindexed packs, unreferenced commits, temp
files) are *warnings*: ``gc`` removes them. A *remote-only* commit (remote_only.py) is walked
down to its blobs; its chunks are on the remote, and their absence here is not a problem
(``remote_only`` counts those commits).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import layout
from .errors import (
    ChecksumMismatch,
    CorruptObject,
    IndexCorrupt,
    ObjectMissing,
    StoreError,
)
from .index import Location
from .lock import FileLock
from .objects import Commit
from .packs import DELTA, PackEntry, decode_payload
from .reader import ObjectReader
from .remote_only import remote_only
from .thinned import thinned

if TYPE_CHECKING:
    from .repository import Repository


@dataclass(frozen=True)
class CheckReport:
    """Result of ``check``."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    commits: int = 0
    trees: int = 0
    blobs: int = 0
    chunks: int = 0
    packs: int = 0
    objects_read: int = 0
    remote_only: int = 0  # reachable commits whose chunks are on a remote only

    @property
    def ok(self) -> bool:
        """True when no problem was found (warnings do not count)."""
        return not self.problems


def check(repo: Repository, *, read_data: bool = False) -> CheckReport:
    """Verify ``repo``; see the module docs."""
    with FileLock(repo.lock_path, shared=True, timeout=repo.lock_timeout):
        return _Checker(repo).run(read_data)


class _Checker:
    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.trees: set[str] = set()
        self.blobs: set[str] = set()
        self.chunks: set[bytes] = set()
        self.objects_read = 0
        self.remote_only = 0
        self.reader = ObjectReader(repo)

    def run(self, read_data: bool) -> CheckReport:
        try:
            return self._run(read_data)
        finally:
            self.reader.close()

    def _run(self, read_data: bool) -> CheckReport:
        repo = self.repo
        packs, pack_problems = layout.read_packs(repo)
        self.problems += pack_problems
        try:
            self._check_index(packs)
        except IndexCorrupt as exc:
            self.problems.append(str(exc))
            return self._report(packs, 0)
        commits = self._check_commits()
        self._walk(commits)
        if read_data:
            self._read_data(packs)
        for tmp in layout.tmp_files(repo):
            self.warnings.append(f"leftover temp file tmp/{tmp.name} (gc removes it)")
        return self._report(packs, len(commits))

    def _report(self, packs: dict[str, list[PackEntry]], ncommits: int) -> CheckReport:
        return CheckReport(list(dict.fromkeys(self.problems)), self.warnings, ncommits, len(self.trees),
                           len(self.blobs), len(self.chunks), len(packs), self.objects_read,
                           self.remote_only)

    def _check_index(self, packs: dict[str, list[PackEntry]]) -> None:
        index = self.repo.index
        indexed = index.packs()
        on_disk = set(layout.pack_files(self.repo))
        for name in sorted(set(indexed) - on_disk):
            self.problems.append(f"pack {name} is in the index but missing on disk")
        for name in sorted(on_disk - set(indexed)):
            self.warnings.append(f"pack {name} is not indexed (interrupted write; gc removes it)")
        by_pack = {name: {(e.id, e.offset): e for e in entries} for name, entries in packs.items()}
        for oid, loc in index.iter_objects():
            entries = by_pack.get(loc.pack)
            if entries is None:
                if loc.pack in on_disk:
                    continue  # the pack itself is reported as corrupt
                self.problems.append(f"object {oid.hex()} in pack {loc.pack}: pack is missing")
                continue
            e = entries.get((oid, loc.offset))
            if e is None or (e.length, e.raw_length, e.type, e.compression) != (
                    loc.length, loc.raw_length, loc.type, loc.compression):
                self.problems.append(
                    f"object {oid.hex()} in pack {loc.pack}: index does not match the pack header")

    def _check_commits(self) -> dict[str, Commit]:
        repo = self.repo
        files = layout.commit_files(repo)
        commits: dict[str, Commit] = {}
        for cid, path in files.items():
            try:
                commits[cid] = layout.load_commit_file(cid, path, repo.key)
            except (StoreError, OSError) as exc:
                self.problems.append(f"commit {cid}: {exc}")
        indexed = set(repo.index.commit_ids())
        for cid in sorted(indexed - set(files)):
            self.problems.append(f"commit {cid} is in the index but its file is missing")
        for cid in sorted(set(files) - indexed):
            self.warnings.append(f"commit {cid} is not indexed (run rebuild-index or gc)")
        reachable: set[str] = set()
        try:
            threads = repo.threads()
        except StoreError as exc:
            self.problems.append(str(exc))
            threads = {}
        stack: list[tuple[str, str]] = []
        for name, tip in threads.items():
            if tip not in files:
                self.problems.append(f"thread {name!r} points to missing commit {tip}")
            else:
                stack.append((tip, f"thread {name!r}"))
        while stack:
            cid, via = stack.pop()
            if cid in reachable:
                continue
            reachable.add(cid)
            c = commits.get(cid)
            if c is None:
                if cid not in files:
                    self.problems.append(f"commit {cid} (reached from {via}) is missing")
                continue
            stack.extend((p, f"commit {cid}") for p in c.parents)
        unreachable = set(commits) - reachable
        if unreachable:
            self.warnings.append(
                f"{len(unreachable)} commit(s) unreachable from any thread (gc removes them)")
        return {cid: c for cid, c in commits.items() if cid in reachable}

    def _walk(self, commits: dict[str, Commit]) -> None:
        try:
            elsewhere = remote_only(self.repo)
        except StoreError as exc:
            self.problems.append(str(exc))
            elsewhere = {}
        self.remote_only = len(set(commits) & set(elsewhere))
        # local commits first: a tree or blob they share with a remote-only one is then
        # checked down to its chunks
        try:
            gone = thinned(self.repo)
        except StoreError as exc:
            self.problems.append(str(exc))
            gone = {}
        for cid, commit in sorted(commits.items(), key=lambda kv: kv[0] in elsewhere):
            if cid not in gone:  # a thinned commit keeps no trees (thinned.py)
                self._tree(commit.tree, f"commit {cid}", cid not in elsewhere)

    def _tree(self, tree_id: str, via: str, local: bool = True) -> None:
        if tree_id in self.trees:
            return
        self.trees.add(tree_id)
        try:
            entries = self.repo.get_tree(tree_id)
        except (ObjectMissing, ChecksumMismatch, CorruptObject) as exc:
            self.problems.append(f"tree {tree_id} (in {via}): {exc}")
            return
        for e in entries:
            if e.kind == "dir":
                self._tree(e.id, f"tree {tree_id}", local)
            elif e.kind == "file":
                self._blob(e.id, e.size, f"tree {tree_id}", local)

    def _blob(self, blob_id: str, size: int, via: str, local: bool = True) -> None:
        if blob_id in self.blobs:
            return
        self.blobs.add(blob_id)
        try:
            blob_size, chunk_ids = self.repo.get_blob_chunks(blob_id)
        except (ObjectMissing, ChecksumMismatch, CorruptObject) as exc:
            self.problems.append(f"blob {blob_id} (in {via}): {exc}")
            return
        if not local:  # its chunks are on the remote (pulled, and verified, on restore)
            if blob_size != size:
                self.problems.append(f"blob {blob_id}: size {blob_size} does not match "
                                     f"tree size {size}")
            return
        locs = self.repo.index.lookup_many(chunk_ids)
        total = 0
        deltas: dict[bytes, Location] = {}
        for cid in chunk_ids:
            loc = locs.get(cid)
            if loc is None:
                self.problems.append(f"chunk {cid.hex()} (in blob {blob_id}) is missing")
                continue
            total += loc.raw_length
            if cid not in self.chunks and loc.compression == DELTA:
                deltas[cid] = loc
            self.chunks.add(cid)
        if blob_size != size or (len(locs) == len(set(chunk_ids)) and total != size):
            self.problems.append(f"blob {blob_id}: size {total} does not match tree size {size}")
        self._delta_sources(deltas)

    def _delta_sources(self, deltas: dict[bytes, Location]) -> None:
        """Every source of every delta chunk is indexed (and, transitively, its sources)."""
        while deltas:
            wanted: dict[bytes, bytes] = {}  # source -> a delta that needs it
            for cid, loc in deltas.items():
                try:
                    for sid in self.reader.sources(cid, loc):
                        wanted.setdefault(sid, cid)
                except (ObjectMissing, ChecksumMismatch) as exc:
                    self.problems.append(f"chunk {cid.hex()}: {exc}")
            found = self.repo.index.lookup_many(list(wanted))
            deltas = {}
            for sid, cid in wanted.items():
                loc = found.get(sid)
                if loc is None:
                    self.problems.append(
                        f"chunk {sid.hex()} (a delta source of chunk {cid.hex()}) is missing")
                    continue
                if sid not in self.chunks and loc.compression == DELTA:
                    deltas[sid] = loc
                self.chunks.add(sid)

    def _read_data(self, packs: dict[str, list[PackEntry]]) -> None:
        files = layout.pack_files(self.repo)
        key = self.repo.key

        def verify(name: str) -> tuple[list[str], int]:
            found: list[str] = []
            count = 0
            with open(files[name], "rb") as f:
                for e in packs[name]:
                    f.seek(e.offset)
                    payload = f.read(e.length)
                    count += 1
                    try:
                        if key is not None:  # an encrypted store's: open it first
                            payload = self.reader.open(e.id, Location(
                                name, e.offset, e.length, e.raw_length, e.type,
                                e.compression), payload)
                        if e.compression == DELTA:
                            self.reader.rebuild(e.id, Location(name, e.offset, e.length,
                                                               e.raw_length, e.type, DELTA),
                                                payload)
                        else:
                            decode_payload(payload, e.id, e.compression, e.raw_length,
                                           f"object {e.id.hex()} in pack {name}", key)
                    except (ChecksumMismatch, ObjectMissing) as exc:
                        found.append(str(exc))
            return found, count

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            for found, count in pool.map(verify, sorted(packs)):
                self.problems += found
                self.objects_read += count
