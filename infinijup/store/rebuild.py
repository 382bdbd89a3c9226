"""``rebuild_index``: recreate the index (a cache) from pack headers and commit files.

Run by ``Repository.open`` when the index file is missing and by ``infinijup store
rebuild-index``; after it, ``check`` finds the index matching the packs again. Damaged packs
and commits are skipped (and counted), not indexed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import layout
from .errors import IndexCorrupt, StoreError
from .lock import FileLock

if TYPE_CHECKING:
    from .repo_view import RepoView


def rebuild_index(repo: RepoView) -> dict[str, int]:
    """Recreate the index from pack headers and commit files under the exclusive lock."""
    with FileLock(repo.lock_path, timeout=repo.lock_timeout):
        try:
            index = repo.index
        except IndexCorrupt:
            repo.close()
            for suffix in ("", "-wal", "-shm"):
                Path(str(repo.index_path) + suffix).unlink(missing_ok=True)
            index = repo.index
        packs, pack_problems = layout.read_packs(repo)
        files = layout.pack_files(repo)
        pack_rows = [(name, files[name].stat().st_size, entries) for name, entries in packs.items()]
        commits = []
        skipped_commits = 0
        for cid, path in layout.commit_files(repo).items():
            try:
                commit = layout.load_commit_file(cid, path, repo.key)
            except (StoreError, OSError):
                skipped_commits += 1
                continue
            commits.append((commit, path.read_bytes()))
        index.replace_all(pack_rows, commits)
        return {"packs": len(pack_rows), "objects": sum(len(e) for _, _, e in pack_rows),
                "commits": len(commits), "skipped_packs": len(pack_problems),
                "skipped_commits": skipped_commits}


__all__ = ["rebuild_index"]
