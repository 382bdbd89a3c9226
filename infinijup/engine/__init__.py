"""The snapshot engine: kernel images in and out of the store, through the helper.

Pure library: no tornado, jupyter_server or IPython imports. ``SnapshotEngine`` moves images
between the privileged helper and the store; ``heads`` holds the thread rules;
``kernel_channel`` talks to a kernel over its own channels (jupyter_client only).
"""

from .engine import DumpResult, SnapshotEngine
from .heads import Head, plan_snapshot

__all__ = ["DumpResult", "Head", "SnapshotEngine", "plan_snapshot"]
