"""The server's side of the remote tier: what the snapshot manager calls.

With ``SnapshotManager.remote`` set (or ``$INFINIJUP_REMOTE``), every commit the server makes
(snapshot, hibernation) is pushed in the background (store/remote_sync.py); with
``local_budget`` (or ``$INFINIJUP_LOCAL_BUDGET``) too, commits safely on the remote leave the
local store, oldest first, when it grows past the budget (store/tiers.py). A restore of such a
remote-only commit pulls it first, with progress on the restore's events (phase ``store``),
unless the hot tier holds its images. A remote-only commit can be restored even with no
remote set here: its record names the remote, and credentials come from boto3's chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from pathlib import Path

from ..errors import InfinijupError, RestoreFailed
from ..store import tiers
from ..store.remote_only import remote_only
from ..store.remote_sync import RemoteSync

REMOTE_ENV = "INFINIJUP_REMOTE"
BUDGET_ENV = "INFINIJUP_LOCAL_BUDGET"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"20G"``, ``"512m"``, ``"1000000"`` (powers of 1024) -> bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a size: {text!r} (bytes, or a number with K, M, G or T)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def remote_from_env() -> str:
    return os.environ.get(REMOTE_ENV, "").strip()


def budget_from_env() -> int:
    text = os.environ.get(BUDGET_ENV, "").strip()
    return parse_bytes(text) if text else 0


class RemoteTier:
    """Background push and eviction for one server (``sync`` is None without a remote)."""

    def __init__(self, manager) -> None:  # noqa: ANN001 - the SnapshotManager
        self.manager = manager
        self.sync: RemoteSync | None = None

    def start(self) -> None:
        m = self.manager
        if not m.remote:
            return
        try:
            self.sync = RemoteSync(Path(m.store_path), m.remote,
                                   budget=lambda: max(0, int(m.local_budget)),
                                   preferred=self._preferred, retry_max=m.remote_retry_max,
                                   logger=m.log)
        except InfinijupError as exc:
            m.log.error("infinijup: background push is off: %s", exc.message)
            return
        self.sync.start()
        m.log.info("infinijup: pushing new commits to %s%s", self.sync.url,
                   f"; local budget {m.local_budget} bytes" if m.local_budget else "")

    async def stop(self, wait: float) -> None:
        """A stopping server: give queued pushes up to ``wait`` seconds, then stop."""
        if self.sync is None:
            return
        if not await asyncio.to_thread(self.sync.wait_idle, wait):
            self.manager.log.warning("infinijup: the server stops with commits not pushed to "
                                     "%s yet; the next server with this store pushes them",
                                     self.sync.url)
        self.sync.stop()

    def committed(self, store_thread: str) -> None:
        """A commit landed on ``store_thread``: push it soon (never raises)."""
        if self.sync is not None:
            self.sync.request(store_thread)

    def budget_changed(self) -> None:
        if self.sync is not None:
            self.sync.evict_soon()

    def status(self, head_commit: str | None) -> dict | None:
        if self.sync is None:
            return None
        return {**self.sync.status(), "head_pushed": self.sync.is_pushed(head_commit)}

    async def images(self, state, engine, commit_id: str, source: dict) -> Path:  # noqa: ANN001 - state: the Operation
        """``engine.materialize`` for a restore, pulling a remote-only commit first (unless
        the hot tier holds its images); ``source["pulled"]`` says what moved."""
        m = self.manager
        repo = m.repo()
        report = m.events.progress(state)

        def progress(done: int, total: int, nbytes: int) -> None:
            report("store", {"percent": 10 + 40 * done / max(total, 1),
                             "message": f"pulling the snapshot from the remote: {done} of "
                                        f"{total} packs, {nbytes / 2**20:.1f} MiB"})

        def hot() -> bool:
            return engine.hot_tier_bytes > 0 and \
                commit_id in {e.commit for e in engine.hot_tier().entries()}

        def pull(unless) -> None:  # noqa: ANN001
            try:
                got = tiers.ensure_local(repo, commit_id, progress=progress, unless=unless)
            except InfinijupError as exc:
                raise RestoreFailed(
                    f"restore failed: snapshot {commit_id[:12]} is on the remote only, and "
                    f"pulling it failed: {exc.message}; the kernel was not touched",
                    reason=exc.reason) from exc
            if got is not None:
                source["pulled"] = {"packs": got.packs_downloaded,
                                    "bytes": got.bytes_downloaded,
                                    "resumed": got.packs_resumed}

        def run() -> Path:
            pull(hot)
            try:
                return engine.materialize(commit_id, source)
            except RestoreFailed:
                # the hot copy went between the check and the link: pull, and once more
                if commit_id not in remote_only(repo):
                    raise
                pull(lambda: False)
                return engine.materialize(commit_id, source)

        pin = self.sync.pinned(commit_id) if self.sync is not None else contextlib.nullcontext()
        with contextlib.ExitStack() as stack:
            stack.enter_context(pin)
            images = await asyncio.to_thread(run)
            if source.get("file_behind") is not None:  # pinned until that file is written
                source["file_behind"].hold(stack.pop_all())
            return images

    def remote_only(self) -> dict[str, str]:
        """Remote-only commit id -> remote (empty when the record cannot be read)."""
        try:
            return remote_only(self.manager.repo())
        except InfinijupError:
            return {}

    def _preferred(self) -> set[str]:
        """Commits evicted last: the heads of this server's kernels and the snapshots that
        hibernated kernels wake from (called in the sync thread: copies, no awaits)."""
        m = self.manager
        out = m.heads.commits()
        out |= {r.commit for r in list(m.hibernation.rests.values()) if r.commit}
        return out
