"""Infinijup's content-addressed snapshot store.

Kernel snapshots (CRIU image directories) are cut into content-defined chunks, deduplicated
by BLAKE3 id, zstd-compressed where it pays and appended to pack files; trees and commits
form a Merkle DAG; threads are named refs moved with compare-and-swap. See docs/store.md.

Typical use::

    repo = Repository.open_or_init(default_store_path())
    c = repo.commit_dir(image_dir, thread="main", metadata={"notebook_path": "a.ipynb"})
    checkout_dir(repo, c.id, restore_dir)  # from infinijup.store.checkout import checkout_dir

Maintenance is functions over a repository, each in its module: ``check.check(repo)``,
``gc.gc(repo)``, ``rebuild.rebuild_index(repo)`` (repository.py's docs say why).
"""

from typing import TYPE_CHECKING

from ..lazy_names import lazy_names

# Each name is imported where it is first used, not with the package: a process that needs a
# few modules of the store (a restore's serving process, engine/store_pages.py) does not pay
# for the rest (check, gc, the checkout: with the engine's, 0.17 s of its 0.45 s of imports
# on the 2-core VM).
_WHERE = {
    "UNSET": "repository",
    "Blob": "objects",
    "CheckReport": "check",
    "ChunkerParams": "chunking",
    "Commit": "objects",
    "Dir": "writer",
    "File": "objects",
    "GcReport": "gc",
    "Repository": "repository",
    "StoreConfig": "config",
    "Symlink": "objects",
    "TreeEntry": "objects",
    "Writer": "writer",
    "default_store_path": "repository",
}

if TYPE_CHECKING:
    from .check import CheckReport
    from .chunking import ChunkerParams
    from .config import StoreConfig
    from .gc import GcReport
    from .objects import Blob, Commit, File, Symlink, TreeEntry
    from .repository import UNSET, Repository, default_store_path
    from .writer import Dir, Writer

__all__ = [
    "UNSET",
    "Blob",
    "CheckReport",
    "ChunkerParams",
    "Commit",
    "Dir",
    "File",
    "GcReport",
    "Repository",
    "StoreConfig",
    "Symlink",
    "TreeEntry",
    "Writer",
    "default_store_path",
]


__getattr__ = lazy_names(__name__, _WHERE, globals())
