"""The record of *thinned* commits: automatic snapshots whose images were let go (issue 30).

A thinned commit keeps its commit file, so the history stays whole: its children still name
it as their parent, and the panel still shows the cell it followed and the variables it had.
Only its trees, blobs and chunks are no longer kept for it: ``gc`` marks nothing under a
thinned commit (what another commit shares stays), ``check`` does not walk it, and a checkout
(a restore) of it is refused with :class:`CommitThinned`.

``<store>/thinned`` is JSON ``{"version": 1, "commits": {commit id: unix time thinned}}``,
replaced atomically under ``refs.lock``. Ids of commits that no longer exist are ignored.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import Conflict
from . import commit_records
from .errors import StoreError

if TYPE_CHECKING:
    from .repository import Repository

RECORD = "thinned"


class CommitThinned(StoreError, Conflict):
    """The commit's images were let go (an automatic snapshot thinned with age)."""

    reason = "commit_thinned"


def _is_time(value: object) -> bool:
    return isinstance(value, (int, float))


def thinned(repo: Repository) -> dict[str, float]:
    """Every thinned commit id -> when it was thinned."""
    return commit_records.read(repo, RECORD, _is_time)


def mark_thinned(repo: Repository, commit_ids: Iterable[str]) -> None:
    """Add ``commit_ids`` to the record, durably (``gc`` then frees what only they held)."""
    ids = [c for c in commit_ids]
    if not ids:
        return
    now = time.time()

    def add(record: dict[str, float]) -> None:
        for c in ids:
            record.setdefault(c, now)

    commit_records.update(repo, RECORD, _is_time, add)


def refuse_thinned(repo: Repository, commit_id: str) -> None:
    if commit_id in thinned(repo):
        raise CommitThinned(f"snapshot {commit_id[:12]} was thinned: automatic snapshots are "
                            "kept for a while, then only some of them (its record stays in the "
                            "history, its images are gone); restore a newer or older one")


__all__ = ["RECORD", "CommitThinned", "mark_thinned", "refuse_thinned", "thinned"]
