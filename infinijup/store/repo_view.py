"""``RepoView``: what the modules below the façade use of a ``Repository``.

repository.py imports reader, writer (and basemap through it), rebuild and layout; they in
turn only need a repository's paths, config, index and a few reads. They name this protocol
instead of ``Repository``, so none of them imports repository.py, not even for type
checking, and the store has no import cycle. ``Repository`` satisfies it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .chunking import Chunker
    from .config import StoreConfig
    from .index import Index
    from .objects import Commit, TreeEntry


class RepoView(Protocol):
    """A store as reader.py, writer.py, basemap.py, layout.py and rebuild.py see it."""

    path: Path
    config: StoreConfig
    chunker: Chunker
    lock_timeout: float
    packs_dir: Path
    commits_dir: Path
    tmp_dir: Path
    lock_path: Path
    index_path: Path
    key: Any  # an encrypted store's local_crypto.StoreKey; None for a plain store

    @property
    def index(self) -> Index: ...

    def close(self) -> None: ...

    def get_tree(self, tree_id: str) -> list[TreeEntry]: ...

    def get_blob_chunks(self, blob_id: str) -> tuple[int, list[bytes]]: ...

    # ``writer`` is a writer.Writer (not named here: writer.py imports this module).
    def commit_tree(self, entries: Mapping[str, Any], *, thread: str, message: str = "",
                    metadata: dict[str, Any] | None = None, parents: list[str] | None = None,
                    expected_tip: str | None = ..., writer: Any = None) -> Commit: ...


__all__ = ["RepoView"]
