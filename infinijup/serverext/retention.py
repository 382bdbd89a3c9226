"""Automatic snapshots kept in a window (issue 30): after an automatic snapshot is stored,
the ones past the window (engine/retention.py) are thinned (store/thinned.py), gc frees what
only they held, and their hot copies go. One pass at a time; a pass asked for meanwhile runs
after it. Thinning never costs a cell: it runs beside the kernel, in a worker thread."""

from __future__ import annotations

import asyncio
import time

from ..engine.retention import Auto, Window, to_thin
from ..errors import InfinijupError
from ..store.gc import gc
from ..store.thinned import mark_thinned, thinned
from . import space


class Retention:
    def __init__(self, manager) -> None:  # noqa: ANN001 - SnapshotManager
        self.m = manager
        self._running = False
        self._again = False
        self.last: dict = {}  # what the last pass did (thinned, freed_bytes)

    def window(self) -> Window:
        m = self.m
        return Window(keep_all_s=m.autosnapshot_keep_all_s, every_s=m.autosnapshot_every_s,
                      max_count=m.autosnapshot_keep, max_bytes=m.autosnapshot_keep_bytes)

    def after_auto(self) -> None:
        """An automatic snapshot was stored."""
        if self._running:
            self._again = True
            return
        self._running = True
        self.m.spawn(self._passes())

    async def _passes(self) -> None:
        try:
            while True:
                self._again = False
                try:
                    await self.once()
                except (InfinijupError, OSError) as exc:
                    self.m.log.warning("infinijup: automatic snapshots not thinned: %s", exc)
                if not self._again:
                    return
        finally:
            self._running = False

    async def once(self, now: float | None = None) -> dict:
        m = self.m
        protected = set(space.needed(m))
        for commits in m.undo_redo.redo_lists.values():
            protected.update(commits)
        window = self.window()

        def run() -> dict:
            repo = m.repo()
            keep = protected | set(repo.threads().values())
            gone = thinned(repo)
            autos = []
            for cid in repo.index.commit_ids():
                if cid in gone:
                    continue
                c = repo.get_commit(cid)
                if (c.metadata or {}).get("auto"):
                    autos.append(Auto(cid, c.created, int((c.stats or {}).get("stored_bytes")
                                                          or 0)))
            ids = to_thin(autos, time.time() if now is None else now, window, keep)
            if not ids:
                return {"thinned": [], "freed_bytes": 0}
            mark_thinned(repo, ids)
            report = gc(repo, keep=protected)
            dropped = space.prune_hot(m, protected, drop=set(ids))
            m.log.info("infinijup: thinned %d automatic snapshots (%d bytes freed in the "
                       "store, %d hot copies dropped)", len(ids), report.bytes_freed,
                       len(dropped))
            return {"thinned": ids, "freed_bytes": report.bytes_freed,
                    "hot_dropped": len(dropped)}

        self.last = await asyncio.to_thread(run)
        return self.last
