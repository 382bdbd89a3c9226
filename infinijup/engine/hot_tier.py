"""The hot tier: the most recent snapshots' images, kept ready in the helper's work dir.

A snapshot's images are dumped into the user's work dir, stored, and then, instead of being
deleted, moved (renamed: no copy) into ``<work>/hot/<commit id>/``. A restore of that commit
then hard-links them into its restore dir instead of checking the commit out of the store:
the helper reads, copies or links what it needs and the restore dir is removed afterwards,
while the hot copy's inodes stay. A restore of any other commit checks out from the store.

Every hot entry is also in the store: it is kept only once its commit is durable. It is used
only when it still matches the commit: its manifest (``<commit id>.json``, written when it
was kept) names the commit, its tree and each file's blob and size as the store has them,
and each file's inode and modification time as they were kept; the linked files are checked
against all of that, and the helper checks its seal of the images as it does for a checkout.
An entry that does not match is dropped, and the restore checks out from the store.

Bounded by ``budget`` bytes (allocated blocks; 0 keeps nothing): least recently used (kept
or restored) first out. It also gives way to the next dump: entries go, oldest first, while
the work dir's filesystem has less free space than the newest entry's size.

Several servers of one user may share the work dir: changes hold ``<work>/hot/.lock``. The
directory's layout (entries, their sizes, dropping one) is ``store/hot_dir.py``, which the store's
command line uses too; ``prune`` drops the copies of snapshots deleted from the store
(serverext/space.py, ``infinijup store rm``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..store import hot_dir
from ..store.hot_dir import Entry
from ..store.hot_dir import allocated as _allocated
from ..store.hot_dir import read_json as _read_json
from ..store.hot_dir import remove as _remove
from ..store.objects import is_hex_id

GiB = 1 << 30


def default_budget() -> int:
    """A quarter of the machine's memory, at most 32 GiB (the work dir may be a tmpfs; a GPU
    kernel's image is its live VRAM plus its RSS: 12 GB for a 4.6 B-parameter bf16 model)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    return min(ram // 4, 32 * GiB)


class HotTier:
    """Images of recent commits under ``root`` (``<work>/hot``), at most ``budget`` bytes."""

    def __init__(self, root: Path, budget: int, store_id: str | None = None) -> None:
        self.root = Path(root)
        self.budget = max(0, int(budget))
        # the store whose commits this server keeps here: one user's servers may use other
        # stores (the tier is per user), and a prune drops only this store's copies
        self.store_id = store_id

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with hot_dir.locked(self.root):
            yield

    # --- keeping --------------------------------------------------------------------------
    def keep(self, images: Path, commit, tree: list) -> bool:  # noqa: ANN001
        """Move ``images``, just committed as ``commit`` (tree entries ``tree``), into the
        tier. Returns whether it was kept; if not, ``images`` is left where it was."""
        files = _tree_files(tree)
        if not self.enabled or files is None or not is_hex_id(commit.id):
            return False
        try:
            manifest = {"commit": commit.id, "tree": commit.tree, "used": time.time(),
                        "store": self.store_id, "files": self._observed(images, files)}
        except (OSError, ValueError):
            return False
        size = _allocated(images)
        if size > self.budget:
            return False
        with self._locked():
            entry = self.root / commit.id
            if entry.exists():  # the same commit twice: cannot happen (ids hash the time)
                return False
            os.rename(images, entry)
            _write_json(self.root / f"{commit.id}.json", {**manifest, "bytes": size})
            self._evict_locked(reserve=size)
        return True

    @staticmethod
    def _observed(images: Path, files: dict[str, tuple[str, int]]) -> dict[str, list]:
        """Each file of ``images`` as the tree has it (blob, size) and as it is now (inode,
        modification time); ValueError when the directory does not hold exactly the tree."""
        names = sorted(os.listdir(images))
        if names != sorted(files):
            raise ValueError("the images are not the committed tree")
        out = {}
        for name in names:
            st = os.stat(images / name, follow_symlinks=False)
            blob, size = files[name]
            if st.st_size != size:
                raise ValueError(f"{name} changed since it was stored")
            out[name] = [blob, size, st.st_ino, st.st_mtime_ns]
        return out

    # --- using ----------------------------------------------------------------------------
    def link_into(self, commit, tree: list, target: Path) -> bool:  # noqa: ANN001
        """Hard-link ``commit``'s hot images into the new directory ``target`` (absent).
        Returns False, leaving no ``target``, when there is no entry that matches."""
        files = _tree_files(tree)
        if not self.enabled or files is None or not is_hex_id(commit.id):
            return False
        entry, manifest_path = self.root / commit.id, self.root / f"{commit.id}.json"
        if not manifest_path.exists():
            return False
        with self._locked():
            manifest = _read_json(manifest_path)
            if not _matches(manifest, commit, files):
                self._drop_locked(commit.id)
                return False
            try:
                os.mkdir(target, 0o700)
            except FileExistsError:
                return False
            try:
                for name, (_blob, size, ino, mtime_ns) in manifest["files"].items():
                    os.link(entry / name, target / name, follow_symlinks=False)
                    st = os.stat(target / name, follow_symlinks=False)
                    if (st.st_size, st.st_ino, st.st_mtime_ns) != (size, ino, mtime_ns):
                        raise ValueError(f"{name} changed in the hot tier")
            except (OSError, ValueError, TypeError):
                shutil.rmtree(target, ignore_errors=True)
                self._drop_locked(commit.id)
                return False
            manifest["used"] = time.time()
            _write_json(manifest_path, manifest)
        return True

    # --- space ----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Complete entries, least recently used first."""
        return hot_dir.entries(self.root)

    def usage(self) -> int:
        """Bytes the tier takes on disk now (allocated; entries and any leftovers)."""
        return hot_dir.usage(self.root)

    def prune(self, keep: Callable[[Entry], bool]) -> list[Entry]:
        """Drop every entry ``keep`` says no to (e.g. its commit left the store); returns
        those dropped."""
        return hot_dir.prune(self.root, keep)

    def room_for(self, size: int, writing: int = 0) -> bool:
        """Whether an entry of ``size`` bytes, ``writing`` of them not yet on the filesystem
        (a copy about to be made for it), would stay once kept: within the budget, and with
        room left for the next dump of its size when every older entry has given way
        (``keep`` evicts down to that). A GPU kernel's 30 GB copy on a 64 GiB disk that also
        holds the store would not: copying it only held the snapshot's answer 13-18 s."""
        if not self.enabled or size > self.budget:
            return False
        where = self.root if self.root.is_dir() else self.root.parent
        held = sum(e.bytes for e in self.entries()) if self.root.is_dir() else 0
        return _free(where) - writing + held >= size

    def make_room(self) -> None:
        """Before a dump: free the filesystem for an image as large as the newest kept one."""
        if not self.root.is_dir():
            return
        with self._locked():
            entries = self.entries()
            if entries:
                self._evict_locked(reserve=max(e.bytes for e in entries))

    def clear(self) -> None:
        if not self.root.is_dir():
            return
        with self._locked():
            for name in os.listdir(self.root):
                if name != ".lock":
                    _remove(self.root / name)

    def _evict_locked(self, reserve: int) -> None:
        self._sweep_locked()
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        while entries and (total > self.budget or _free(self.root) < reserve):
            oldest = entries.pop(0)
            self._drop_locked(oldest.commit)
            total -= oldest.bytes

    def _sweep_locked(self) -> None:
        """Remove what is not a complete entry (a server killed while keeping one)."""
        for name in os.listdir(self.root):
            if name == ".lock":
                continue
            stem = name[:-5] if name.endswith(".json") else name
            if not is_hex_id(stem) or not ((self.root / stem).is_dir()
                                           and (self.root / f"{stem}.json").is_file()):
                _remove(self.root / name)

    def _drop_locked(self, commit_id: str) -> None:
        hot_dir.drop_locked(self.root, commit_id)  # manifest first: no half entry is ever used


def _tree_files(tree: list) -> dict[str, tuple[str, int]] | None:
    """name -> (blob id, size) of a flat tree of files (a CRIU images dir); else None."""
    files = {}
    for e in tree:
        if e.kind != "file":
            return None
        files[e.name] = (e.id, e.size)
    return files


def _matches(manifest: dict | None, commit, files: dict[str, tuple[str, int]]) -> bool:  # noqa: ANN001
    if not isinstance(manifest, dict) or manifest.get("commit") != commit.id \
            or manifest.get("tree") != commit.tree:
        return False
    kept = manifest.get("files")
    if not isinstance(kept, dict) or sorted(kept) != sorted(files):
        return False
    return all(isinstance(v, list) and len(v) == 4 and (v[0], v[1]) == files[name]
               for name, v in kept.items())


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
