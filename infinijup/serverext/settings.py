"""The server's settings of Infinijup (``c.SnapshotManager.<name>`` in
``jupyter_server_config.py``), apart from the manager that acts on them (manager.py)."""

from __future__ import annotations

from traitlets import Bool, Float, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

from ..engine.hot_tier import default_budget
from ..store import default_store_path
from .remote_tier import budget_from_env, remote_from_env


class ManagerSettings(LoggingConfigurable):
    """What ``SnapshotManager`` can be configured with (it inherits them)."""

    store_path = Unicode(help="The snapshot store (default: $INFINIJUP_STORE or "
                              "~/.local/share/infinijup/store).").tag(config=True)
    busy_timeout = Float(30.0, help="Seconds a snapshot or restore waits for a busy kernel "
                                    "before answering 409.").tag(config=True)
    answer_timeout = Float(60.0, help="Seconds a restored kernel has to answer.").tag(config=True)
    autosnapshot = Bool(False, help="Kernels snapshot themselves after a cell when that is cheap "
                                    "compared with the cell (see autosnapshot_share), and "
                                    "always after a long one (autosnapshot_after_s), so that "
                                    "Undo can go back before any cell. A kernel's own "
                                    "%autosnapshot and Lab's setting override it."
                        ).tag(config=True)
    autosnapshot_share = Float(0.05, help="An automatic snapshot is taken when its predicted "
                                          "pause is at most this share of the cell's run time."
                               ).tag(config=True)
    autosnapshot_after_s = Float(60.0, help="Seconds after which a cell is always followed by "
                                            "an automatic snapshot.").tag(config=True)
    autosnapshot_keep_all_s = Float(3600.0, help="Automatic snapshots younger than this are all "
                                                 "kept; older ones are thinned to one per "
                                                 "autosnapshot_every_s.").tag(config=True)
    autosnapshot_every_s = Float(600.0, help="Past autosnapshot_keep_all_s, one automatic "
                                             "snapshot per this many seconds is kept."
                                 ).tag(config=True)
    autosnapshot_keep = Integer(200, help="At most this many automatic snapshots are kept (the "
                                          "oldest are thinned first).").tag(config=True)
    autosnapshot_keep_bytes = Integer(0, help="The store bytes automatic snapshots may hold "
                                              "together (0: no limit); past it the oldest are "
                                              "thinned.").tag(config=True)
    autosnapshot_ingest_nice = Integer(10, help="An automatic snapshot's images are stored "
                                               "this many nice levels below the server while "
                                               "the kernel runs its next cells (0: at the "
                                               "server's priority).").tag(config=True)
    hot_tier_bytes = Integer(help="Bytes of recent snapshots' images kept ready in the helper's "
                                  "work dir, so that restoring them skips the store checkout "
                                  "(default: a quarter of the memory, at most 32 GiB; 0: none)."
                             ).tag(config=True)
    lazy_restore = Bool(True, help="Restores (and wakes, undos) answer before the kernel's "
                                    "memory is back: its pages come on first touch and stream "
                                    "in behind (CRIU's lazy pages). Only where the helper runs "
                                    "CRIU as root and for CPU memory; other restores are whole "
                                    "and say why.").tag(config=True)

    undo_sets_aside = Bool(True, help="An undo (or redo) of a kernel changed since its last "
                                      "snapshot restores beside it and stores the state it left "
                                      "afterwards, instead of first (serverext/undo.py): the "
                                      "kernel's memory is held twice meanwhile. Only for CPU "
                                      "kernels in PID namespaces, with the memory free."
                           ).tag(config=True)

    restore_keeps_replaced = Bool(True, help="A lazy restore in place whose images are not in "
                                             "the hot tier keeps the kernel it replaces aside, "
                                             "alive, until the restored memory is all back, so "
                                             "that its page files may stream from the store "
                                             "(serverext/aside.py): a failed stream gives the "
                                             "kernel back as it was. The kernel's memory is held "
                                             "twice meanwhile. Only for CPU kernels in PID "
                                             "namespaces, with the memory free; off (or "
                                             "elsewhere): the page files are checked out first."
                                  ).tag(config=True)

    undo_stores_behind = Bool(True, help="Where a kernel is not set aside (undo_sets_aside), "
                                         "an undo (or redo) of a kernel changed since its last "
                                         "snapshot dumps it, then restores while its images "
                                         "are stored; off: the store is waited for before the "
                                         "restore.").tag(config=True)

    pages_from_store_min_bytes = Integer(
        1 << 30, help="A lazy wake or resume whose images are not in the hot tier leaves the "
                      "page files in the store (read as the kernel runs, "
                      "engine/store_pages.py) when they hold at least this many bytes; "
                      "smaller ones are checked out, which is quicker for them.").tag(config=True)

    hibernate_after = Float(0.0, help="Seconds a kernel may stay idle before it is hibernated: "
                                      "snapshotted and its process ended; the next cell wakes "
                                      "it (0: never).").tag(config=True)
    gpu_release_after = Float(0.0, help="Seconds a GPU kernel may stay idle before its GPU "
                                        "memory moves to host memory, freeing the GPU; the next "
                                        "cell brings it back (0: never).").tag(config=True)
    hibernate_on_shutdown = Bool(False, help="Hibernate every idle Infinijup kernel when the "
                                             "server stops (a JupyterHub idle culler, a "
                                             "restart): the next server wakes each on the "
                                             "notebook's next cell. A kernel that is running a "
                                             "cell is not waited for.").tag(config=True)
    make_room_on_wake = Bool(True, help="When a released kernel's GPU memory does not fit back "
                                        "on its GPUs, release the least recently active idle "
                                        "kernels holding memory there first (never a busy "
                                        "one). Off: the wake fails with the reason."
                             ).tag(config=True)
    make_room_for_running = Bool(True, help="A running kernel whose GPU allocation finds no "
                                            "room (Infinijup's VMM allocator sees it first) may "
                                            "have idle kernels give way as for a wake; never a "
                                            "busy one. Off: it gets CUDA's out-of-memory error."
                                 ).tag(config=True)
    make_room_hibernate = Bool(True, help="When making room, an idle kernel whose GPU memory "
                                          "host memory cannot keep (but can pass through) is "
                                          "hibernated to the store instead of released; its "
                                          "next cell wakes it. Off: it is passed over."
                               ).tag(config=True)
    gpu_release_through_arena = Bool(True, help="Release and wake move PyTorch's GPU memory "
                                                "through the kernel's VMM arena at copy-engine "
                                                "speed; the driver's checkpoint takes the rest. "
                                                "Off: the driver's checkpoint takes all of it."
                                      ).tag(config=True)
    idle_check_interval = Float(10.0, help="Seconds between two checks for idle kernels."
                                ).tag(config=True)
    remote = Unicode(help="A remote store, s3://bucket/prefix, that every new commit is pushed "
                          "to in the background (default: $INFINIJUP_REMOTE; empty: none). "
                          "Endpoint and credentials as for `infinijup store push`."
                     ).tag(config=True)
    local_budget = Integer(help="Bytes the local store may hold (default: "
                                "$INFINIJUP_LOCAL_BUDGET, e.g. 20G; 0: no limit). Past it, "
                                "commits safely on the remote leave the local store, oldest "
                                "first; restoring one pulls it back.").tag(config=True)
    remote_retry_max = Float(300.0, help="Seconds between retries of a failed background "
                                         "push, at most (the delay doubles from 1 s)."
                             ).tag(config=True)
    remote_shutdown_wait = Float(60.0, help="Seconds a stopping server waits for queued "
                                            "pushes.").tag(config=True)

    @default("store_path")
    def _default_store_path(self) -> str:
        return str(default_store_path())

    @default("hot_tier_bytes")
    def _default_hot_tier_bytes(self) -> int:
        return default_budget()

    @default("remote")
    def _default_remote(self) -> str:
        return remote_from_env()

    @default("local_budget")
    def _default_local_budget(self) -> int:
        return budget_from_env()
