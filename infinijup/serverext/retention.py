"""Automatic snapshots kept in a window (issue 30): after an automatic snapshot is stored,
the ones past the window (engine/retention.py) are thinned (store/thinned.py), gc frees what
only they held, and their hot copies go. One pass at a time; a pass asked for meanwhile runs
after it. Thinning never costs a cell: it runs beside the kernel, in a worker thread.

A pass is cheap while nothing is thinned: the automatic snapshots come from the index's
metadata (``find_commits``), and each commit is read once per server (commits never change);
the window thins in batches (engine/retention.py), so the whole-store gc runs once per batch,
not once per cell.
"""

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
        self.autos: dict[str, Auto] = {}  # commit id -> what a pass needs of it (read once)

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
        protected = set(space.needed(m)) | m.undo_redo.protected()
        window = self.window()

        def run() -> dict:
            repo = m.repo()
            ids = to_thin(automatic(repo, self.autos), time.time() if now is None else now,
                          window, protected | set(repo.threads().values()))
            if not ids:
                return {"thinned": [], "freed_bytes": 0}
            mark_thinned(repo, ids)
            for cid in ids:
                self.autos.pop(cid, None)
            report = gc(repo, keep=protected)
            dropped = space.prune_hot(m, protected, drop=set(ids))
            m.log.info("infinijup: thinned %d automatic snapshots (%d bytes freed in the "
                       "store, %d hot copies dropped)", len(ids), report.bytes_freed,
                       len(dropped))
            return {"thinned": ids, "freed_bytes": report.bytes_freed,
                    "hot_dropped": len(dropped)}

        self.last = await asyncio.to_thread(run)
        return self.last


def automatic(repo, known: dict[str, Auto]) -> list[Auto]:  # noqa: ANN001 - Repository
    """The store's automatic snapshots not thinned. Found in the index's metadata; a commit
    not in ``known`` is read once and added (commits never change); ``known`` keeps only
    those returned."""
    gone = thinned(repo)
    out = []
    ids = [c for c in repo.index.find_commits({"auto": True}) if c not in gone]
    for cid in ids:
        a = known.get(cid)
        if a is None:
            c = repo.get_commit(cid)
            a = known[cid] = Auto(cid, c.created, int((c.stats or {}).get("stored_bytes") or 0))
        out.append(a)
    for cid in set(known) - set(ids):
        del known[cid]
    return out
