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

from collections.abc import Iterable
from typing import TYPE_CHECKING

from . import commit_records

if TYPE_CHECKING:
    from .repository import Repository

RECORD = "remote-only"


def _is_url(value: object) -> bool:
    return isinstance(value, str)


def remote_only(repo: Repository) -> dict[str, str]:
    """Every remote-only commit id -> the remote that holds its chunks."""
    return commit_records.read(repo, RECORD, _is_url)


def mark_remote_only(repo: Repository, commits: dict[str, str]) -> None:
    """Add ``commits`` (id -> remote URL) to the record, durably."""
    if commits:
        commit_records.update(repo, RECORD, _is_url, lambda record: record.update(commits))


def mark_local(repo: Repository, commit_ids: Iterable[str]) -> None:
    """Remove commits from the record (their chunks are local again), durably."""
    ids = [c for c in commit_ids]

    def drop(record: dict[str, str]) -> None:
        for c in ids:
            record.pop(c, None)

    if ids:
        commit_records.update(repo, RECORD, _is_url, drop)


__all__ = ["RECORD", "mark_local", "mark_remote_only", "remote_only"]
