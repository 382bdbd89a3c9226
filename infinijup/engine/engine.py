"""Kernel images between the privileged helper and the store.

Snapshot: the helper dumps the kernel tree (left running) into a fresh directory of its work
area; the images are committed to the store; the directory is removed. Restore: the commit is
checked out completely (every chunk verified) before the running kernel is touched; only then
does the helper replace the kernel with the restored tree.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InfinijupError, RestoreFailed, SnapshotFailed

Progress = Callable[[str, dict], None]


def _no_progress(phase: str, detail: dict) -> None:
    pass


@dataclass(frozen=True)
class DumpResult:
    commit: object  # infinijup.store.Commit
    image_bytes: int
    stored_bytes: int
    pause_s: float
    duration_s: float
    phases: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    duration_s: float
    phases: dict = field(default_factory=dict)


class SnapshotEngine:
    """Snapshot and restore kernel process trees, given a store and a helper client."""

    def __init__(self, repo, helper) -> None:
        self.repo = repo
        self.helper = helper
        self._work_dir: Path | None = None

    def work_dir(self) -> Path:
        if self._work_dir is None:
            self._work_dir = Path(self.helper.work_dir())
        return self._work_dir

    def _new_dir(self, kind: str) -> Path:
        parent = self.work_dir() / kind
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return parent / uuid.uuid4().hex

    def _discard(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            try:
                self.helper.release(str(path))
            except InfinijupError:
                pass

    def snapshot(
        self,
        pid: int,
        *,
        thread: str,
        message: str,
        metadata: dict,
        parents: list[str],
        expected_tip: str | None,
        on_progress: Progress = _no_progress,
    ) -> DumpResult:
        """Dump the tree rooted at ``pid`` (left running) and commit it on store ``thread``."""
        t0 = time.perf_counter()
        images = self._new_dir("images")
        try:
            on_progress("dump", {"percent": 30})
            dump = self.helper.dump(pid, str(images), leave_running=True,
                                    on_progress=lambda ph, d: on_progress(ph, d))
            pause_s = float(dump.duration_s)
            t_dump = time.perf_counter()
            on_progress("store", {"percent": 60, "bytes": dump.image_bytes})
            meta = dict(metadata)
            if dump.gpu:
                meta["gpu"] = dict(dump.gpu)
            meta["timings"] = {**meta.get("timings", {}), "dump_s": pause_s,
                               **{f"helper_{k}_s": v for k, v in dump.phases.items()}}
            commit = self.repo.commit_dir(
                images, thread=thread, message=message, metadata=meta,
                parents=parents, expected_tip=expected_tip,
            )
        except InfinijupError:
            raise
        except Exception as exc:
            raise SnapshotFailed(f"snapshot failed: {exc}") from exc
        finally:
            self._discard(images)
        t1 = time.perf_counter()
        stats = dict(getattr(commit, "stats", {}) or {})
        return DumpResult(
            commit=commit,
            image_bytes=int(stats.get("image_bytes", dump.image_bytes)),
            stored_bytes=int(stats.get("stored_bytes", 0)),
            pause_s=pause_s,
            duration_s=t1 - t0,
            phases={"dump_s": t_dump - t0, "store_s": t1 - t_dump},
        )

    def release_gpu(self, pid: int) -> dict:
        """Move the live kernel's VRAM to host memory and free its GPUs (no CRIU, no store)."""
        return self.helper.gpu(pid, "release")

    def reacquire_gpu(self, pid: int) -> dict:
        """Bring a released kernel's memory back onto its GPUs."""
        return self.helper.gpu(pid, "reacquire")

    def materialize(self, commit_id: str) -> Path:
        """Check a commit's images out into a fresh directory of the helper's work area."""
        target = self._new_dir("restore")
        try:
            self.repo.checkout_dir(commit_id, target)
        except BaseException:
            self._discard(target)
            raise
        return target

    def restore(self, images: Path, replace_pid: int | None,
                on_progress: Progress = _no_progress) -> RestoreResult:
        """Replace the tree at ``replace_pid`` with the one in ``images``; remove ``images``."""
        t0 = time.perf_counter()
        try:
            result = self.helper.restore(str(images), replace_pid=replace_pid,
                                         on_progress=lambda ph, d: on_progress(ph, d))
        except InfinijupError as exc:
            raise RestoreFailed(f"restore failed: {exc}", reason=getattr(exc, "reason", None)) from exc
        finally:
            self._discard(images)
        return RestoreResult(pid=result.pid, duration_s=time.perf_counter() - t0,
                             phases=dict(result.phases))
