"""``gc``: remove commits no thread reaches and the objects only they used.

Plan, then execute, all under the *exclusive* store lock (no writer can be deduplicating
against or writing anything gc decides about):

plan
    mark every commit reachable from a thread tip (or from a commit the caller names in
    ``keep``: one a kernel stands on, space.py), and every tree, blob and chunk they use
    (none for a thinned commit, thinned.py: its commit file alone stays)
    (a remote-only commit's trees and blobs only: its chunks are on a remote, remote_only.py),
    and the sources of every page-delta chunk among them (refusing to go on if any of it is
    missing or damaged: run check); sort packs into
    *keep*, *repack* (>= ``REPACK_UNUSED`` of their bytes unused) and *delete* (nothing used).
execute (each step durable before the next, so a crash leaves a valid store)
    1. copy live objects of repack packs into new packs (verified on read), index them;
    2. forget garbage commits in the index, then delete their files;
    3. forget deleted/repacked packs in the index, then delete the files;
    4. delete unindexed packs and temp files left by interrupted writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import fsutil, layout
from .errors import StoreError
from .faults import crashpoint
from .lock import FileLock
from .objects import Commit
from .packs import DELTA, PackWriter, decode_payload, pack_path
from .reader import ObjectReader
from .remote_only import remote_only
from .thinned import thinned

if TYPE_CHECKING:
    from .repository import Repository

REPACK_UNUSED = 0.10


@dataclass(frozen=True)
class GcReport:
    """What gc removed (or, with ``dry_run``, would remove)."""

    dry_run: bool
    commits_removed: list[str] = field(default_factory=list)
    packs_deleted: list[str] = field(default_factory=list)
    packs_repacked: list[str] = field(default_factory=list)
    packs_written: list[str] = field(default_factory=list)
    objects_removed: int = 0
    bytes_freed: int = 0
    leftovers_removed: int = 0


def gc(repo: Repository, *, dry_run: bool = False, keep: Iterable[str] = ()) -> GcReport:
    """Collect garbage in ``repo``; see the module docs. ``keep``: commits kept (with their
    ancestors) though no thread reaches them; ids not in the store are ignored."""
    with FileLock(repo.lock_path, timeout=repo.lock_timeout):
        plan = _plan(repo, set(keep))
        if dry_run:
            return GcReport(True, sorted(plan.garbage_commits), sorted(plan.delete),
                            sorted(plan.repack), [], plan.objects_removed, plan.bytes_freed,
                            len(plan.orphans) + len(plan.tmp))
        report = _execute(repo, plan)
    repo.index.truncate_journal()  # shrink the WAL after the rows removed (lock released)
    return report


@dataclass
class _Plan:
    live: set[bytes]
    garbage_commits: dict[str, int]  # id -> file size
    delete: dict[str, int]  # pack -> size
    repack: dict[str, int]
    orphans: dict[str, int]  # unindexed pack files
    tmp: list[str]
    objects_removed: int = 0
    bytes_freed: int = 0


def _plan(repo: Repository, keep: set[str]) -> _Plan:
    files = layout.commit_files(repo)
    reachable: dict[str, Commit] = {}
    stack = list(repo.threads().values()) + sorted(k for k in keep if k in files)
    while stack:
        cid = stack.pop()
        if cid in reachable:
            continue
        if cid not in files:
            raise StoreError(f"gc refused: commit {cid} is missing (run check)")
        reachable[cid] = layout.load_commit_file(cid, files[cid], repo.key)
        stack.extend(reachable[cid].parents)
    live: set[bytes] = set()
    elsewhere = remote_only(repo)
    gone = thinned(repo)  # their commit files stay (the history), nothing under them
    for commit in sorted(reachable.values(), key=lambda c: c.id in elsewhere):
        if commit.id not in gone:
            _mark_tree(repo, commit.tree, live, chunks=commit.id not in elsewhere)
    _mark_delta_sources(repo, live)
    indexed_live = repo.index.known(list(live))
    if len(indexed_live) != len(live):
        missing = min(live - indexed_live).hex()
        raise StoreError(f"gc refused: live object {missing} is not indexed (run check)")
    garbage_commits = {cid: p.stat().st_size for cid, p in files.items() if cid not in reachable}
    for cid in repo.index.commit_ids():
        if cid not in reachable and cid not in garbage_commits:
            garbage_commits[cid] = 0
    plan = _sort_packs(repo, live, garbage_commits)
    on_disk = layout.pack_files(repo)
    packs = repo.index.packs()
    plan.orphans = {n: p.stat().st_size for n, p in on_disk.items() if n not in packs}
    plan.tmp = [p.name for p in layout.tmp_files(repo)]
    plan.bytes_freed += sum(plan.orphans.values()) + sum(garbage_commits.values())
    return plan


def drop_unused(repo: Repository, live: set[bytes]) -> GcReport:
    """Delete or repack, as gc does, the packs holding objects that are not in ``live``;
    commits, unindexed packs and temp files are left alone. The caller holds the exclusive
    store lock and made ``live`` under it (tiers.py: every object a local commit needs)."""
    return _execute(repo, _sort_packs(repo, live, {}))


def _sort_packs(repo: Repository, live: set[bytes], garbage_commits: dict[str, int]) -> _Plan:
    """Sort the indexed packs into keep, repack and delete for a given live set."""
    packs = repo.index.packs()
    used: dict[str, int] = {name: 0 for name in packs}
    dead_objects: dict[str, int] = {name: 0 for name in packs}
    for oid, loc in repo.index.iter_objects():
        if oid in live:
            used[loc.pack] += loc.length
        else:
            dead_objects[loc.pack] += 1
    plan = _Plan(live, garbage_commits, {}, {}, {}, [])
    for name, (size, _count) in packs.items():
        if used[name] == 0:
            plan.delete[name] = size
        elif size - used[name] >= REPACK_UNUSED * size:
            plan.repack[name] = size
        plan.objects_removed += dead_objects[name] if (name in plan.delete or name in plan.repack) \
            else 0
    plan.bytes_freed = (sum(plan.delete.values()) + sum(plan.repack.values())
                        - sum(used[n] for n in plan.repack))
    return plan


def _mark_tree(repo: Repository, tree_id: str, live: set[bytes], *, chunks: bool = True
               ) -> None:
    """Add a tree and everything under it to ``live`` (``chunks`` False: trees and blobs
    only; callers mark the commits whose chunks are live first)."""
    oid = bytes.fromhex(tree_id)
    if oid in live:
        return
    live.add(oid)
    for e in repo.get_tree(tree_id):
        if e.kind == "dir":
            _mark_tree(repo, e.id, live, chunks=chunks)
        elif e.kind == "file":
            bid = bytes.fromhex(e.id)
            if bid not in live:
                live.add(bid)
                if chunks:
                    live.update(repo.get_blob_chunks(e.id)[1])


def _mark_delta_sources(repo: Repository, live: set[bytes]) -> None:
    """Add the sources of every live page-delta chunk to ``live`` (transitively)."""
    todo = list(live)
    with ObjectReader(repo) as reader:
        while todo:
            found = repo.index.lookup_many(todo)
            todo = []
            for oid, loc in found.items():
                if loc.compression != DELTA:
                    continue
                try:
                    sources = reader.sources(oid, loc)
                except StoreError as exc:
                    raise StoreError(f"gc refused: {exc} (run check)") from exc
                for sid in sources:
                    if sid not in live:
                        live.add(sid)
                        todo.append(sid)


def _execute(repo: Repository, plan: _Plan) -> GcReport:
    index = repo.index
    written: list[str] = []
    if plan.repack:
        written = _repack(repo, plan)
        crashpoint("gc_after_repack")
    if plan.garbage_commits:
        index.remove_commits(plan.garbage_commits)
        crashpoint("gc_after_commit_index")
        for cid in plan.garbage_commits:
            fsutil.unlink_durable(repo.commits_dir / cid[:2] / cid)
        crashpoint("gc_after_commit_files")
    doomed = [*plan.delete, *plan.repack]
    if doomed:
        index.remove_packs(doomed)
        crashpoint("gc_after_pack_index")
        for name in doomed:
            fsutil.unlink_durable(pack_path(repo.packs_dir, name))
        crashpoint("gc_after_pack_files")
    for name in plan.orphans:
        fsutil.unlink_durable(pack_path(repo.packs_dir, name))
    for tmp in plan.tmp:
        (repo.tmp_dir / tmp).unlink(missing_ok=True)
    return GcReport(False, sorted(plan.garbage_commits), sorted(plan.delete),
                    sorted(plan.repack), written, plan.objects_removed, plan.bytes_freed,
                    len(plan.orphans) + len(plan.tmp))


def _repack(repo: Repository, plan: _Plan) -> list[str]:
    """Copy the live objects of the packs to repack into new packs; index them there."""
    written: list[str] = []
    writer: PackWriter | None = None
    current, f = "", None

    def finish(w: PackWriter) -> None:
        name, _path, size = w.finish()
        repo.index.add_packs([(name, size, w.entries)], replace=True)
        written.append(name)
        plan.bytes_freed -= size - sum(e.length for e in w.entries)

    reader = ObjectReader(repo)
    try:
        for oid, loc in repo.index.iter_objects():  # grouped by pack, in file order
            if loc.pack not in plan.repack or oid not in plan.live:
                continue
            if loc.pack != current:
                if f is not None:
                    f.close()
                current, f = loc.pack, open(pack_path(repo.packs_dir, loc.pack), "rb")
            f.seek(loc.offset)
            payload = f.read(loc.length)  # copied as it is (sealed, in an encrypted store)
            plain = payload if repo.key is None else reader.open(oid, loc, payload)
            if loc.compression == DELTA:  # verified by rebuilding it from its sources
                reader.rebuild(oid, loc, plain)
            else:
                decode_payload(plain, oid, loc.compression, loc.raw_length,
                               f"object {oid.hex()} in pack {loc.pack}", repo.key)
            if writer is None:
                writer = PackWriter(repo.packs_dir, repo.tmp_dir, key=repo.key)
            writer.add(loc.type, oid, payload, loc.compression, loc.raw_length)
            if writer.size >= repo.config.pack_size:
                finish(writer)
                writer = None
        if writer is not None:
            finish(writer)
            writer = None
    finally:
        reader.close()
        if f is not None:
            f.close()
        if writer is not None:
            writer.abort()
    return written
