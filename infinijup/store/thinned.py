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

import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import Conflict
from . import fsutil
from .errors import CorruptObject, StoreError
from .lock import FileLock
from .objects import is_hex_id

if TYPE_CHECKING:
    from .repository import Repository

RECORD = "thinned"


class CommitThinned(StoreError, Conflict):
    """The commit's images were let go (an automatic snapshot thinned with age)."""

    reason = "commit_thinned"


def thinned(repo: Repository) -> dict[str, float]:
    """Every thinned commit id -> when it was thinned."""
    try:
        data = (repo.path / RECORD).read_bytes()
    except FileNotFoundError:
        return {}
    try:
        obj = json.loads(data)
        commits = obj["commits"]
        if obj.get("version") != 1 or not isinstance(commits, dict):
            raise ValueError("unknown layout")
        if not all(is_hex_id(k) and isinstance(v, (int, float)) for k, v in commits.items()):
            raise ValueError("bad entry")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptObject(f"{repo.path / RECORD} is damaged ({exc})") from None
    return dict(commits)


def mark_thinned(repo: Repository, commit_ids: Iterable[str]) -> None:
    """Add ``commit_ids`` to the record, durably (``gc`` then frees what only they held)."""
    ids = [c for c in commit_ids]
    if not ids:
        return
    with FileLock(repo.refs_lock_path, timeout=repo.lock_timeout):
        record = thinned(repo)
        now = time.time()
        added = {c: now for c in ids if c not in record}
        if not added:
            return
        record.update(added)
        body = json.dumps({"version": 1, "commits": dict(sorted(record.items()))},
                          indent=0).encode() + b"\n"
        fsutil.atomic_write(repo.path / RECORD, body, tmp_dir=repo.tmp_dir)


def refuse_thinned(repo: Repository, commit_id: str) -> None:
    if commit_id in thinned(repo):
        raise CommitThinned(f"snapshot {commit_id[:12]} was thinned: automatic snapshots are "
                            "kept for a while, then only some of them (its record stays in the "
                            "history, its images are gone); restore a newer or older one")


__all__ = ["RECORD", "CommitThinned", "mark_thinned", "refuse_thinned", "thinned"]
