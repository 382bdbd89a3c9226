"""Records of commits in a special state, kept beside the store's objects: a JSON file
``{"version": 1, "commits": {commit id: value}}`` at ``<store>/<name>``, replaced atomically
under ``refs.lock``. Used by remote_only.py (value: the remote's URL) and thinned.py (value:
when it was thinned). Ids of commits that no longer exist are ignored by readers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import fsutil
from .errors import CorruptObject
from .lock import FileLock
from .objects import is_hex_id

if TYPE_CHECKING:
    from .repository import Repository


def read(repo: Repository, name: str, value_ok: Callable[[Any], bool]) -> dict[str, Any]:
    """The record ``name`` (empty when absent); CorruptObject if it is damaged."""
    try:
        data = (repo.path / name).read_bytes()
    except FileNotFoundError:
        return {}
    try:
        obj = json.loads(data)
        commits = obj["commits"]
        if obj.get("version") != 1 or not isinstance(commits, dict):
            raise ValueError("unknown layout")
        if not all(is_hex_id(k) and value_ok(v) for k, v in commits.items()):
            raise ValueError("bad entry")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptObject(f"{repo.path / name} is damaged ({exc})") from None
    return dict(commits)


def update(repo: Repository, name: str, value_ok: Callable[[Any], bool],
           change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the record ``name`` under ``refs.lock``; written durably, and only
    if it changed."""
    with FileLock(repo.refs_lock_path, timeout=repo.lock_timeout):
        record = read(repo, name, value_ok)
        before = dict(record)
        change(record)
        if record == before:
            return
        body = json.dumps({"version": 1, "commits": dict(sorted(record.items()))},
                          indent=0).encode() + b"\n"
        fsutil.atomic_write(repo.path / name, body, tmp_dir=repo.tmp_dir)
