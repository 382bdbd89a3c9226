"""The snapshot engine: kernel images in and out of the store, through the helper.

Pure library: no tornado, jupyter_server or IPython imports. ``SnapshotEngine`` moves images
between the privileged helper and the store; ``hot_tier`` keeps recent images ready for
restores; ``heads`` holds the thread rules; ``kernel_channel`` talks to a kernel over its own
channels (jupyter_client only).
"""

from typing import TYPE_CHECKING

from ..lazy_names import lazy_names

# Imported where first used: the serving process of a restore (store_pages.py) needs none of
# the engine but its own module.
_WHERE = {
    "DumpResult": "engine",
    "Dumped": "engine",
    "Head": "heads",
    "HotTier": "hot_tier",
    "SnapshotEngine": "engine",
    "plan_snapshot": "heads",
}

if TYPE_CHECKING:
    from .engine import Dumped, DumpResult, SnapshotEngine
    from .heads import Head, plan_snapshot
    from .hot_tier import HotTier

__all__ = ["DumpResult", "Dumped", "Head", "HotTier", "SnapshotEngine", "plan_snapshot"]


__getattr__ = lazy_names(__name__, _WHERE, globals())
