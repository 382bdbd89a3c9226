"""Kernel images between the privileged helper and the store.

Snapshot: the helper dumps the kernel tree (left running) into a fresh directory of its work
area; ``on_dumped`` hears of it at once (the kernel runs again from then on, while the images
are stored); the images are committed to the store; the directory then goes to the hot tier
(hot_tier.py) or is removed. Restore: the commit's images come from the hot tier when it holds
them, else they are checked out completely (every chunk verified); either way before the
running kernel is touched. Only then does the helper replace the kernel with the restored tree.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import InfinijupError, PreflightRefused, RestoreFailed, SnapshotFailed
from ..process import start_time
from ..store import checkout as store_checkout
from ..store.errors import RefConflict
from ..store.faults import holdpoint
from ..store.objects import Blob, File, TreeEntry
from ..store.remote_only import remote_only
from ..store.thinned import CommitThinned
from ..store.writer import entries_from_dir
from . import criu_hints
from .extra_files import FileChanges, HotCopy, StoredVersions, data_bytes, open_extra
from .file_behind import FileBehind
from .hot_tier import HotTier, _allocated
from .ingest_progress import CountingWriter, IngestProgress, Progress
from .niced import run_niced
from .store_pages import SOCKET, StorePagesProcess, checkout_serving_pages, pages_worth_serving

_TAGGED = re.compile(r"^(\d+)\.(\d+)\.[0-9a-f]{32}$")  # <pid>.<start time>.<uuid>


def _no_progress(phase: str, detail: dict) -> None:
    pass


@dataclass(frozen=True)
class Dumped:
    """A kernel dumped into the work dir (it runs again), its images not yet stored."""

    images: Path
    image_bytes: int
    pause_s: float
    phases: dict = field(default_factory=dict)  # the helper's
    gpu: dict | None = None
    extra: dict = field(default_factory=dict)  # name -> fd of a file stored beside the images
    changes: FileChanges | None = None  # what the kernel said of them (extra_files.py)


@dataclass(frozen=True)
class DumpResult:
    commit: object  # infinijup.store.Commit
    image_bytes: int
    stored_bytes: int
    pause_s: float
    duration_s: float
    phases: dict = field(default_factory=dict)
    hot: bool = False  # its images were kept in the hot tier
    read_bytes: int = 0  # of the images and extra files, to store them (incremental.py)


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    duration_s: float
    phases: dict = field(default_factory=dict)


class SnapshotEngine:
    """Snapshot and restore kernel process trees, given a store and a helper client."""

    def __init__(self, repo, helper, hot_tier_bytes: int = 0, lazy_restore: bool = False,
                 ingest_nice: int = 0, pages_from_store_min_bytes: int = 1 << 30,
                 stored_versions: StoredVersions | None = None) -> None:
        self.repo = repo
        self.helper = helper
        self.hot_tier_bytes = hot_tier_bytes  # 0: no hot tier (see hot_tier.py)
        self.lazy_restore = lazy_restore  # restores run before the memory is back (helper)
        self.ingest_nice = ingest_nice  # a background snapshot's ingest, this much nicer
        self._work_dir: Path | None = None
        self._hot: HotTier | None = None
        self._lazy_here: bool | None = None  # the helper takes our restores lazily
        self.pages_from_store_min_bytes = pages_from_store_min_bytes
        self._page_sources: dict[str, StorePagesProcess] = {}  # images dir -> its pages' server
        # the extra files' last blobs (extra_files.py): the server's, kept across engines
        self.stored_versions = stored_versions if stored_versions is not None else StoredVersions()

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

    def hot_tier(self) -> HotTier:
        if self._hot is None:
            self._hot = HotTier(self.work_dir() / "hot", self.hot_tier_bytes,
                                store_id=self.repo.config.id)
        return self._hot

    def _discard(self, path: Path) -> None:
        source = self._page_sources.pop(str(path), None)
        if source is not None:  # materialized, never restored
            source.stop_listening()
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
        on_dumped: Callable[[Dumped], None] | None = None,
        replan: Callable[[RefConflict], dict] | None = None,
        extra_files: dict[str, str] | None = None,
        file_changes: FileChanges | None = None,
        background: bool = False,
        leave_running: bool = True,
    ) -> DumpResult:
        """Dump the tree rooted at ``pid`` (left running) and commit it on store ``thread``.

        ``on_dumped`` is called as soon as the kernel is dumped and runs again, before the
        images are stored. ``replan``, given the conflict when ``thread`` moved meanwhile,
        returns new ``thread``/``metadata``/``parents``/``expected_tip`` for the same images
        (the kernel may have moved on since: it is never dumped twice).

        ``extra_files``: name -> path of files the kernel wrote while quiesced (its GPU
        segments), stored beside the images. Each is held open under a shared lock from now
        until it is stored: the kernel, running again, waits for that before writing it anew.
        ``file_changes``: where they changed since the kernel's earlier snapshot, if it knows.

        ``background``: nobody waits for the commit (an automatic snapshot): the images are
        stored ``ingest_nice`` nice levels below the caller, so that the kernel's next cells
        come first (niced.py).

        ``leave_running=False``: the tree is ended and reaped once dumped (a kernel an undo set
        aside: undo.py).
        """
        t0 = time.perf_counter()
        dumped = replace(self.dump(pid, on_progress, leave_running=leave_running),
                         changes=file_changes)
        try:
            dumped.extra.update(open_extra(extra_files or {}))
        except BaseException:
            self._discard(dumped.images)
            raise
        hot_copy: HotCopy | None = None
        try:
            if on_dumped is not None:
                on_dumped(dumped)
            t_dump = time.perf_counter()
            target = {"thread": thread, "metadata": metadata, "parents": parents,
                      "expected_tip": expected_tip}

            def store():  # noqa: ANN202
                nonlocal target
                for attempt in range(3):
                    try:
                        return self.commit(dumped, message=message, on_progress=on_progress,
                                           **target)
                    except RefConflict as exc:
                        if replan is None or attempt == 2:
                            raise
                        target = replan(exc)
                raise AssertionError("unreachable")

            nice = self.ingest_nice if background else 0
            hot_copy = self._start_hot_copy(dumped, nice)
            commit = run_niced(store, nice)
            t_store = time.perf_counter()
            hot = self.keep_hot(dumped, commit, hot_copy)
        finally:
            if hot_copy is not None:  # stopped if the store failed; done (a no-op) if not
                hot_copy.cancel()
                self._discard(hot_copy.where)
            self._discard(dumped.images)  # nothing left to remove when it went hot
            for fd in dumped.extra.values():
                os.close(fd)
        t1 = time.perf_counter()
        stats = dict(getattr(commit, "stats", {}) or {})
        return DumpResult(
            commit=commit,
            image_bytes=int(stats.get("image_bytes", dumped.image_bytes)),
            stored_bytes=int(stats.get("stored_bytes", 0)),
            pause_s=dumped.pause_s,
            duration_s=t1 - t0,
            phases={"dump_s": t_dump - t0, "store_s": t_store - t_dump, "hot_s": t1 - t_store},
            hot=hot,
            read_bytes=int(stats.get("read_bytes", 0)),
        )

    def dump(self, pid: int, on_progress: Progress = _no_progress,
             leave_running: bool = True) -> Dumped:
        """Dump the tree rooted at ``pid`` (left running, unless told) into a fresh images
        dir."""
        if self.hot_tier_bytes > 0:
            try:
                self.hot_tier().make_room()  # the hot tier never fills the disk under a dump
            except OSError:
                pass
        images = self._new_dir("images")
        try:
            on_progress("dump", {"percent": 30})
            dump = self.helper.dump(pid, str(images), leave_running=leave_running,
                                    on_progress=lambda ph, d: on_progress(ph, d))
        except InfinijupError as exc:
            self._discard(images)
            told = criu_hints.explain(exc)
            if told is None:
                raise
            raise told from exc
        except Exception as exc:
            self._discard(images)
            raise SnapshotFailed(f"snapshot failed: {exc}") from exc
        return Dumped(images=images, image_bytes=int(dump.image_bytes),
                      pause_s=float(dump.duration_s), phases=dict(dump.phases),
                      gpu=dict(dump.gpu) if dump.gpu else None)

    def commit(self, dumped: Dumped, *, thread: str, message: str, metadata: dict,
               parents: list[str], expected_tip: str | None,
               on_progress: Progress = _no_progress):
        """Store ``dumped``'s images as a commit on ``thread``; durable when it returns.
        The images stay where they are (``keep_hot`` or ``discard`` them)."""
        meta = dict(metadata)
        if dumped.gpu:
            meta["gpu"] = dict(dumped.gpu)
        meta["timings"] = {**meta.get("timings", {}), "dump_s": dumped.pause_s,
                           **{f"helper_{k}_s": v for k, v in dumped.phases.items()}}
        try:
            holdpoint("before_ingest")
            with self.repo.writer() as w:
                counted = CountingWriter(w, IngestProgress(on_progress, dumped.image_bytes))
                base_tree = self._base_tree(parents, thread)
                top = entries_from_dir(counted, dumped.images, base_tree)
                extra = self._extra_entries(counted, dumped, base_tree)
                commit = w.commit({**top.entries, **extra}, thread=thread, message=message,
                                  metadata=meta, parents=parents, expected_tip=expected_tip)
            if dumped.changes is not None and extra:
                self.stored_versions.remember(self.repo.config.id, dumped.changes.token,
                                              commit.id,
                                              {name: f.blob for name, f in extra.items()})
            return commit
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

    def _extra_entries(self, writer, dumped: Dumped, base_tree: str | None) -> dict:  # noqa: ANN001
        """The extra files as tree entries, each against the parent's file of the same name
        (most of a model's segments do not change between two snapshots)."""
        if not dumped.extra:
            return {}
        old = {}
        if base_tree is not None:
            try:
                old = {e.name: e for e in self.repo.get_tree(base_tree)}
            except InfinijupError:
                old = {}
        out = {}
        for name, fd in dumped.extra.items():
            stored = self.stored_versions.base(self.repo.config.id, dumped.changes, name)
            # (not where that commit's chunks left for a remote since: the new blob would
            # name chunks this store no longer has; the writer's shared lock keeps them now)
            if stored is not None and stored[0] not in remote_only(self.repo):
                # read only where the kernel says the file changed
                blob = writer.add_changed_file(fd, base=stored[1],
                                               changed=dumped.changes.changed)
                out[name] = File(blob, 0o600)
                continue
            e = old.get(name)
            base = Blob(e.id, e.size) if e is not None and e.kind == "file" else None
            out[name] = File(writer.add_file(f"/proc/self/fd/{fd}", base=base), 0o600)
        return out

    def _base_tree(self, parents: list[str], thread: str) -> str | None:
        """The tree the new images are stored against (page deltas); as Repository.commit_dir."""
        base = getattr(self.repo, "_base_tree", None)
        return base(parents, thread) if base is not None else None

    def _start_hot_copy(self, dumped: Dumped, nice: int) -> HotCopy | None:
        """The extra files' copy for the hot tier (their live data only: holes stay holes),
        started beside the store's ingest; None where there is nothing to copy or the tier
        could not take it."""
        if self.hot_tier_bytes <= 0 or not dumped.extra:
            return None
        try:
            extra = sum(data_bytes(fd) for fd in dumped.extra.values())
            if not self.hot_tier().room_for(_allocated(dumped.images) + extra, writing=extra):
                return None  # the tier would not keep it: no copy to wait for
            return HotCopy(dumped.extra, self._new_dir("hotcopy"), nice)
        except (OSError, InfinijupError):
            return None

    def keep_hot(self, dumped: Dumped, commit, hot_copy: HotCopy | None = None) -> bool:  # noqa: ANN001
        """Move the committed images into the hot tier (if it takes them), with the copy of
        the extra files (``hot_copy``), which must be whole: without it, a snapshot with
        extra files stays out of the tier."""
        if self.hot_tier_bytes <= 0:
            return False
        try:
            if dumped.extra:
                if hot_copy is None or not hot_copy.copied():
                    return False
                for name in dumped.extra:
                    os.rename(hot_copy.where / name, dumped.images / name)
            return self.hot_tier().keep(dumped.images, commit, self.repo.get_tree(commit.tree))
        except (OSError, InfinijupError):
            return False  # a cache: the commit is in the store either way

    def discard(self, dumped: Dumped) -> None:
        self._discard(dumped.images)

    def release_gpu(self, pid: int) -> dict:
        """Move the live kernel's VRAM to host memory and free its GPUs (no CRIU, no store)."""
        return self.helper.gpu(pid, "release")

    def reacquire_gpu(self, pid: int) -> dict:
        """Bring a released kernel's memory back onto its GPUs."""
        return self.helper.gpu(pid, "reacquire")

    def materialize(self, commit_id: str, info: dict | None = None) -> Path:
        """A commit's images in a fresh directory of the helper's work area: linked from the
        hot tier when it holds them, else checked out of the store (but for the page files,
        which the store serves as the restore needs them, where ``info["pages_may_stream"]``
        and the helper restores lazily: store_pages.py; and but for the file named
        ``info["behind"]``, checked out beside the directory by a thread as the restore goes
        on: ``info["file_behind"]``, file_behind.py). ``info`` gets ``source`` ("hot" or
        "store"), ``checkout_s`` and ``pages_from_store``."""
        t0 = time.perf_counter()
        target = self._new_dir("restore")
        if self._link_hot(commit_id, target):
            if info is not None:
                info.update(source="hot", checkout_s=time.perf_counter() - t0)
            return target
        try:
            if (info or {}).get("pages_may_stream") and self._pages_from_store(commit_id):
                self._checkout_serving_pages(commit_id, target)
            elif (behind := self._entry_behind(commit_id, (info or {}).get("behind"))) is not None:
                store_checkout.checkout_dir(self.repo, commit_id, target,
                                            leave_out=frozenset({behind.name}))
                info["file_behind"] = FileBehind(self.repo, behind,
                                                 target.parent / f"{target.name}.{behind.name}")
            else:
                store_checkout.checkout_dir(self.repo, commit_id, target)
        except CommitThinned:  # no damage: its images went with age (409, the reason)
            self._discard(target)
            raise
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
        if info is not None:
            info.update(source="store", checkout_s=time.perf_counter() - t0,
                        pages_from_store=str(target) in self._page_sources)
        return target

    def _entry_behind(self, commit_id: str, name: str | None) -> TreeEntry | None:
        if not name:
            return None
        tree = self.repo.get_tree(self.repo.get_commit(commit_id).tree)
        return next((e for e in tree if e.name == name and e.kind == "file"), None)

    def _pages_from_store(self, commit_id: str) -> bool:
        """Restores leave large page files in the store where the helper restores lazily
        (store_pages.py); not a GPU kernel's, which the helper restores whole."""
        if (self.repo.get_commit(commit_id).metadata or {}).get("gpu"):
            return False
        if not self.lazy_restore or not pages_worth_serving(
                self.repo, commit_id, self.pages_from_store_min_bytes):
            return False
        if self._lazy_here is None:
            self._lazy_here = bool(self.helper.hello().features.get("lazy_pages"))
        return self._lazy_here

    def _checkout_serving_pages(self, commit_id: str, target: Path) -> None:
        source = checkout_serving_pages(self.repo, commit_id, target)
        if source is not None:
            self._page_sources[str(target)] = source

    def _link_hot(self, commit_id: str, target: Path) -> bool:
        if self.hot_tier_bytes <= 0:
            return False
        try:
            commit = self.repo.get_commit(commit_id)
            return self.hot_tier().link_into(commit, self.repo.get_tree(commit.tree), target)
        except (OSError, InfinijupError):
            self._discard(target)
            return False

    def restore(self, images: Path, replace_pid: int | None,
                on_progress: Progress = _no_progress,
                gpu_map: tuple[tuple[str, str], ...] = (),
                path_map: tuple[tuple[str, str], ...] = (),
                log_path: str | None = None, park: bool = False) -> RestoreResult:
        """Replace the tree at ``replace_pid`` with the one in ``images``; remove ``images``.
        ``park``: that tree is set aside alive, not ended (refused before anything is touched
        where it cannot be: reason ``cannot_park``).

        ``gpu_map`` pairs (saved GPU UUID, GPU UUID here) move GPU state onto other GPUs;
        ``path_map`` and ``log_path`` put the kernel into another session (retarget.py).
        """
        t0 = time.perf_counter()
        started: list[str] = []

        def progress(phase: str, detail: dict) -> None:
            if detail.get("state") == "started":
                started.append(phase)
            on_progress(phase, detail)

        source = self._page_sources.pop(str(images), None)
        try:
            result = self.helper.restore(str(images), replace_pid=replace_pid,
                                         on_progress=progress, gpu_map=gpu_map,
                                         path_map=path_map, log_path=log_path,
                                         lazy=self.lazy_restore,
                                         page_source=SOCKET if source is not None else None,
                                         park=park)
        except InfinijupError as exc:
            if getattr(exc, "reason", None) == "missing_files":  # refused before any kill
                raise PreflightRefused(f"cannot restore here: {exc}",
                                       reason="missing_files") from exc
            failed = RestoreFailed(f"restore failed: {exc}", reason=getattr(exc, "reason", None))
            # The helper vanished while CRIU was restoring: CRIU (its child) may still finish,
            # leaving a restored tree that nobody was told about (see orphans.py).
            failed.tree_may_exist = (getattr(exc, "reason", None) == "helper_disconnected"
                                     and "restore" in started)
            # A kernel set aside (``park``) whose connections the helper shut down: the
            # server reconnects to it once its socket files are back (restore_flow.py).
            failed.parked = (park and "restore" in started
                             and getattr(exc, "reason", None) != "cannot_park")
            raise failed from exc
        finally:
            if source is not None:
                source.stop_listening()  # the helper has connected by now, or never will
            self._discard(images)
        phases = dict(result.phases)
        if self.lazy_restore:  # the memory still streaming in, or why it was restored whole
            phases["pages"] = dict(result.pages) if result.pages else None
            phases["whole_why"] = result.whole_why
        return RestoreResult(pid=result.pid, duration_s=time.perf_counter() - t0, phases=phases)
