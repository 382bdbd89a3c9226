"""Kernel images between the privileged helper and the store.

Snapshot: the helper dumps the kernel tree (left running) into a fresh directory of its work
area; the images are committed to the store; the directory is removed. Restore: the commit is
checked out completely (every chunk verified) before the running kernel is touched; only then
does the helper replace the kernel with the restored tree.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InfinijupError, RestoreFailed, SnapshotFailed
from ..process import start_time

Progress = Callable[[str, dict], None]
_TAGGED = re.compile(r"^(\d+)\.(\d+)\.[0-9a-f]{32}$")  # <pid>.<start time>.<uuid>


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
        """A fresh directory name under ``<work>/<kind>``, tagged with this process (pid and
        start time), after removing those left by processes that are gone: a server killed
        mid-operation must not leave hundreds of MiB of images behind for ever."""
        parent = self.work_dir() / kind
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sweep(parent)
        return parent / f"{os.getpid()}.{start_time(os.getpid())}.{uuid.uuid4().hex}"

    def _sweep(self, parent: Path) -> None:
        try:
            entries = os.listdir(parent)
        except OSError:
            return
        for name in entries:
            match = _TAGGED.match(name)
            if match and start_time(int(match[1])) != int(match[2]):
                self._discard(parent / name)

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
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SnapshotFailed(
                    f"snapshot failed: the store's filesystem is full ({exc.strerror}; store "
                    f"{getattr(self.repo, 'path', '?')}): free space, or delete threads you no "
                    "longer need and run `infinijup store gc`; the kernel was left running",
                    reason="no_space") from exc
            raise SnapshotFailed(f"snapshot failed: {exc}") from exc
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
        except InfinijupError as exc:
            self._discard(target)
            # A commit that resolved but cannot be read back (a damaged or missing pack) is
            # a failed restore (500), not an unknown commit; the kernel was not touched.
            raise RestoreFailed(f"restore failed: the snapshot's images cannot be read from "
                                f"the store ({exc.message}); the kernel was not touched; "
                                "`infinijup store check --read-data` names the damage",
                                reason=exc.reason) from exc
        except OSError as exc:
            self._discard(target)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise RestoreFailed(f"restore failed: cannot check the snapshot out into "
                                f"{target.parent}: {exc.strerror or exc}; the kernel was not "
                                "touched", reason="no_space" if full else "checkout_failed") from exc
        except BaseException:
            self._discard(target)
            raise
        return target

    def restore(self, images: Path, replace_pid: int | None,
                on_progress: Progress = _no_progress,
                gpu_map: tuple[tuple[str, str], ...] = (),
                port_map: tuple[tuple[int, int], ...] = (),
                log_path: str | None = None) -> RestoreResult:
        """Replace the tree at ``replace_pid`` with the one in ``images``; remove ``images``.

        ``gpu_map`` pairs (saved GPU UUID, GPU UUID here) move GPU state onto other GPUs;
        ``port_map`` and ``log_path`` put the kernel into another session (retarget.py).
        """
        t0 = time.perf_counter()
        started: list[str] = []

        def progress(phase: str, detail: dict) -> None:
            if detail.get("state") == "started":
                started.append(phase)
            on_progress(phase, detail)

        try:
            result = self.helper.restore(str(images), replace_pid=replace_pid,
                                         on_progress=progress, gpu_map=gpu_map,
                                         port_map=port_map, log_path=log_path)
        except InfinijupError as exc:
            failed = RestoreFailed(f"restore failed: {exc}", reason=getattr(exc, "reason", None))
            # The helper vanished while CRIU was restoring: CRIU (its child) may still finish,
            # leaving a restored tree that nobody was told about (see orphans.py).
            failed.tree_may_exist = (getattr(exc, "reason", None) == "helper_disconnected"
                                     and "restore" in started)
            raise failed from exc
        finally:
            self._discard(images)
        return RestoreResult(pid=result.pid, duration_s=time.perf_counter() - t0,
                             phases=dict(result.phases))
