"""Listing what is on disk in a store (shared by check, gc and rebuild-index)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .objects import is_hex_id

if TYPE_CHECKING:
    from .repository import Repository


def pack_files(repo: Repository) -> dict[str, Path]:
    """Every pack file: name -> path."""
    return _fanout(repo.packs_dir)


def commit_files(repo: Repository) -> dict[str, Path]:
    """Every commit file: id -> path."""
    return _fanout(repo.commits_dir)


def tmp_files(repo: Repository) -> list[Path]:
    """Leftovers in tmp/ (packs and ref/commit temp files of interrupted writes)."""
    if not repo.tmp_dir.is_dir():
        return []
    return sorted(p for p in repo.tmp_dir.iterdir() if p.is_file())


def _fanout(root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    if not root.is_dir():
        return out
    for sub in sorted(root.iterdir()):
        if not sub.is_dir():
            continue
        for f in sorted(sub.iterdir()):
            if is_hex_id(f.name) and f.name[:2] == sub.name:
                out[f.name] = f
    return out
