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
from ..store.gc import GcReport, gc
from ..store.thinned import RECORD, mark_thinned, thinned
from . import space


class Retention:
    def __init__(self, manager) -> None:  # noqa: ANN001 - SnapshotManager
        self.m = manager
        self._running = False
        self._again = False
        self.last: dict = {}  # what the last pass did (thinned, freed_bytes)
        self.found = Automatic()  # the automatic snapshots, found cheaply

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
            ids, report = thin_pass(repo, window, protected, self.found,
                                    time.time() if now is None else now)
            if not ids:
                return {"thinned": [], "freed_bytes": 0}
            dropped = space.prune_hot(m, protected, drop=set(ids))
            m.log.info("infinijup: thinned %d automatic snapshots (%d bytes freed in the "
                       "store, %d hot copies dropped)", len(ids), report.bytes_freed,
                       len(dropped))
            return {"thinned": ids, "freed_bytes": report.bytes_freed,
                    "hot_dropped": len(dropped)}

        self.last = await asyncio.to_thread(run)
        return self.last


def thin_pass(repo, window: Window, protected: set[str], found: Automatic,  # noqa: ANN001
              now: float) -> tuple[list[str], GcReport | None]:
    """One pass on the store (a worker thread's): thin what the window says (``protected``
    and every thread's tip spared), then gc keeping ``protected``. (ids thinned, gc's report:
    None when nothing was thinned.)"""
    ids = to_thin(found(repo), now, window, protected | set(repo.threads().values()))
    if not ids:
        return [], None
    mark_thinned(repo, ids)
    return ids, gc(repo, keep=protected)


class Automatic:
    """The store's automatic snapshots not thinned, pass after pass, without reading the whole
    store: their ids from the index's metadata (``find_commits``), each commit read once (commits
    never change), the record of thinned commits read again only when its file changed (it is
    replaced whole at each change: a new inode)."""

    def __init__(self) -> None:
        self.known: dict[str, Auto] = {}
        self._gone: tuple[tuple[int, int, int] | None, set[str]] = (None, set())

    def __call__(self, repo) -> list[Auto]:  # noqa: ANN001 - Repository
        gone = self.thinned(repo)
        ids = [c for c in repo.index.find_commits({"auto": True}) if c not in gone]
        out = []
        for cid in ids:
            a = self.known.get(cid)
            if a is None:
                c = repo.get_commit(cid)
                a = self.known[cid] = Auto(cid, c.created,
                                           int((c.stats or {}).get("stored_bytes") or 0))
            out.append(a)
        for cid in set(self.known) - set(ids):
            del self.known[cid]
        return out

    def thinned(self, repo) -> set[str]:  # noqa: ANN001 - Repository
        try:
            st = (repo.path / RECORD).stat()
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = None
        if key is None or key != self._gone[0]:
            self._gone = (key, set(thinned(repo)))
        return self._gone[1]
