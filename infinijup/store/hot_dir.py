"""The hot tier's directory as the store sees it: which commits have hot copies, what they take
on disk, and dropping them.

The hot tier (engine/hot_tier.py) keeps recent snapshots' images, uncompressed, under
``<helper work dir>/hot``: ``<commit id>/`` (the images) and ``<commit id>.json`` (its manifest,
written last and removed first, so that an entry without one is never used). Every change holds
``<hot>/.lock`` (flock). This is the part that needs nothing of the engine: the store's command
line measures and prunes the tier with it (``infinijup store stats``, ``rm``, ``gc``), and the
engine's ``HotTier`` keeps and links entries on top of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .objects import is_hex_id

LOCK = ".lock"


@dataclass(frozen=True)
class Entry:
    """One complete hot entry: its commit, its bytes (allocated, when kept), last use."""

    commit: str
    bytes: int
    used: float
    store: str | None = None  # the id of the store it was kept for (None: kept before that)


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold the tier's lock (made, with the directory, if missing)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def allocated(path: Path) -> int:
    """Allocated bytes of the files directly in ``path`` (an images directory is flat)."""
    total = 0
    with os.scandir(path) as it:
        for item in it:
            if item.is_file(follow_symlinks=False):
                total += item.stat(follow_symlinks=False).st_blocks * 512
    return total


def usage(root: Path) -> int:
    """Allocated bytes of everything under ``root`` (entries and any leftovers); 0 if absent."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def entries(root: Path) -> list[Entry]:
    """Complete entries (images and manifest), least recently used first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".json") or not is_hex_id(name[:-5]):
            continue
        manifest = read_json(root / name)
        if manifest is None or not (root / name[:-5]).is_dir():
            continue
        store = manifest.get("store")
        out.append(Entry(name[:-5], int(manifest.get("bytes", 0)),
                         float(manifest.get("used", 0.0)),
                         store if isinstance(store, str) else None))
    return sorted(out, key=lambda e: e.used)


def drop_locked(root: Path, commit_id: str) -> None:
    """Remove one entry (the caller holds the lock): its manifest first, then its images."""
    remove(root / f"{commit_id}.json")
    remove(root / commit_id)


def prune(root: Path, keep: Callable[[Entry], bool]) -> list[Entry]:
    """Drop every complete entry ``keep`` says no to; returns those dropped."""
    if not root.is_dir():
        return []
    dropped = []
    with locked(root):
        for entry in entries(root):
            if not keep(entry):
                drop_locked(root, entry.commit)
                dropped.append(entry)
    return dropped


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
