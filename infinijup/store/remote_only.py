"""The record of *remote-only* commits: those whose chunks were evicted from the local store
because a remote holds them (tiers.py).

A remote-only commit keeps its commit file, its trees and its blobs (the lists of chunk ids)
in the local store, so history, ``log``, ``show`` and the hot tier work as before; only its
chunks (the bytes of its images) are on the remote alone, and reading them needs a pull
(``remote.fetch_commit_data``). ``check`` and ``gc`` read this record: a remote-only commit's
absent chunks are not damage, and gc does not count them as live.

``<store>/remote-only`` is JSON ``{"version": 1, "commits": {commit id: remote URL}}``,
replaced atomically under ``refs.lock``. The URL is ``s3://bucket/prefix`` (no endpoint, no
credentials). Ids of commits that no longer exist are ignored by readers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from . import fsutil
from .errors import CorruptObject
from .lock import FileLock
from .objects import is_hex_id

if TYPE_CHECKING:
    from .repository import Repository

RECORD = "remote-only"


def remote_only(repo: Repository) -> dict[str, str]:
    """Every remote-only commit id -> the remote that holds its chunks."""
    try:
        data = (repo.path / RECORD).read_bytes()
    except FileNotFoundError:
        return {}
    try:
        obj = json.loads(data)
        commits = obj["commits"]
        if obj.get("version") != 1 or not isinstance(commits, dict):
            raise ValueError("unknown layout")
        if not all(is_hex_id(k) and isinstance(v, str) for k, v in commits.items()):
            raise ValueError("bad entry")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptObject(f"{repo.path / RECORD} is damaged ({exc})") from None
    return dict(commits)


def mark_remote_only(repo: Repository, commits: dict[str, str]) -> None:
    """Add ``commits`` (id -> remote URL) to the record, durably."""
    if commits:
        _update(repo, lambda record: record.update(commits))


def mark_local(repo: Repository, commit_ids: Iterable[str]) -> None:
    """Remove commits from the record (their chunks are local again), durably."""
    ids = [c for c in commit_ids]

    def drop(record: dict[str, str]) -> None:
        for c in ids:
            record.pop(c, None)

    if ids:
        _update(repo, drop)


def _update(repo: Repository, change) -> None:  # noqa: ANN001 - a callable on the dict
    with FileLock(repo.refs_lock_path, timeout=repo.lock_timeout):
        record = remote_only(repo)
        before = dict(record)
        change(record)
        if record == before:
            return
        body = json.dumps({"version": 1, "commits": dict(sorted(record.items()))},
                          indent=0).encode() + b"\n"
        fsutil.atomic_write(repo.path / RECORD, body, tmp_dir=repo.tmp_dir)


__all__ = ["RECORD", "mark_local", "mark_remote_only", "remote_only"]
