"""Listing and reading what is on disk in a store (shared by check, gc and rebuild)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ChecksumMismatch, CorruptObject, CorruptPack
from .objects import Commit, decode_commit, hash_bytes, is_hex_id
from .packs import PackEntry, read_pack_header

if TYPE_CHECKING:
    from .repo_view import RepoView


def pack_files(repo: RepoView) -> dict[str, Path]:
    """Every pack file: name -> path."""
    return _fanout(repo.packs_dir)


def commit_files(repo: RepoView) -> dict[str, Path]:
    """Every commit file: id -> path."""
    return _fanout(repo.commits_dir)


def tmp_files(repo: RepoView) -> list[Path]:
    """Leftovers in tmp/ (packs and ref/commit temp files of interrupted writes)."""
    if not repo.tmp_dir.is_dir():
        return []
    return sorted(p for p in repo.tmp_dir.iterdir() if p.is_file())


def read_packs(repo: RepoView) -> tuple[dict[str, list[PackEntry]], list[str]]:
    """Parse every pack header on disk: (name -> entries, problems)."""
    packs: dict[str, list[PackEntry]] = {}
    problems: list[str] = []
    for name, path in pack_files(repo).items():
        try:
            header, entries = read_pack_header(path, repo.key)
        except CorruptPack as exc:
            problems.append(str(exc))
            continue
        if id_of(repo.key, header).hex() != name:
            problems.append(f"pack {name}: name does not match its header")
            continue
        packs[name] = entries
    return packs, problems


def id_of(key: Any, data: bytes | memoryview) -> bytes:
    """The id of ``data``: its BLAKE3, or its keyed BLAKE3 in an encrypted store (``key``,
    a local_crypto.StoreKey)."""
    return hash_bytes(data) if key is None else key.object_id(data)


def commit_file_bytes(key: Any, commit_id: str, body: bytes) -> bytes:
    """What a commit's file holds: its body, sealed in an encrypted store."""
    return body if key is None else key.seal_named("commit", commit_id, body)


def commit_body(key: Any, commit_id: str, data: bytes) -> bytes:
    """The verified body of a commit from its file's bytes ``data``."""
    if key is not None:
        try:
            data = key.open_named("commit", commit_id, data)
        except CorruptObject as exc:
            raise ChecksumMismatch(str(exc)) from None
    if id_of(key, data).hex() != commit_id:
        raise ChecksumMismatch(f"commit {commit_id}: checksum mismatch")
    return data


def load_commit_file(commit_id: str, path: Path, key: Any = None) -> Commit:
    """Read and verify one commit file."""
    return decode_commit(commit_id, commit_body(key, commit_id, path.read_bytes()))


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
