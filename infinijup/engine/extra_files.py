"""Files the kernel wrote while quiesced (its GPU segments, gpu_vmm.py), stored beside its
images: opened safely and held under a shared lock until stored, stored from what changed
since the kernel's last snapshot where it says (``StoredVersions``), and copied into the hot
tier with their holes left holes (``HotCopy``: beside the store's ingest)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..errors import SnapshotFailed
from ..store.objects import Blob
from .niced import raise_own_nice

log = logging.getLogger(__name__)

STEP = 256 << 20  # bytes copied per call: a cancelled copy stops within one


def open_extra(paths: dict[str, str]) -> dict[str, int]:
    """Open each file (never through a symlink, only one of this user), shared-locked."""
    out: dict[str, int] = {}
    try:
        for name, path in paths.items():
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            out[name] = fd
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise SnapshotFailed(f"snapshot failed: {path} is not a file of this user")
            fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        for fd in out.values():
            os.close(fd)
        raise SnapshotFailed(f"snapshot failed: the kernel's {exc.filename or 'file'} cannot "
                             f"be read: {exc.strerror}") from exc
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def data_ranges(fd: int):  # noqa: ANN202
    """(offset, length) of the data of a file, holes left out (SEEK_DATA / SEEK_HOLE)."""
    size = os.fstat(fd).st_size
    at = 0
    while at < size:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end - start
        at = end


def data_bytes(fd: int) -> int:
    return sum(n for _, n in data_ranges(fd))


def copy_sparse(fd: int, target: Path, stop: threading.Event | None = None) -> None:
    """Copy the file open at ``fd`` to ``target`` (new, 0600), its holes left holes; an
    OSError (ECANCELED) once ``stop`` is set."""
    size = os.fstat(fd).st_size
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(out, size)
        for start, length in data_ranges(fd):
            done = 0
            while done < length:
                if stop is not None and stop.is_set():
                    raise OSError(errno.ECANCELED, f"copy into {target} stopped")
                at, left = start + done, min(length - done, STEP)
                try:
                    n = os.copy_file_range(fd, out, left, at, at)
                except OSError as exc:  # across filesystems (EXDEV), or not supported
                    if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS,
                                         errno.EOPNOTSUPP):
                        raise
                    n = os.pwrite(out, os.pread(fd, min(left, 8 << 20), at), at)
                if n == 0:
                    raise OSError(errno.EIO, f"short copy into {target}")
                done += n
    finally:
        os.close(out)


class HotCopy:
    """The extra files copied into ``where`` (a new directory) for the hot tier, in a thread,
    while the store takes them in: both read them, the copy writes the disk while the store
    hashes, and the commit is not followed by a copy of its own (a 29 GB GPU kernel's
    snapshot after a small change was durable 43 s after the press on an H200 host, 22-28 s
    of it storing; the copy after it was not timed alone; one on 7.9 GB, 11.4-11.9 s before and
    9.0-9.1 s with the copy beside). The thread runs ``nice`` levels
    below the caller, as the ingest of an automatic snapshot does (niced.py). A cache: a copy
    that fails leaves the snapshot out of the tier, nothing more."""

    def __init__(self, extra: dict[str, int], where: Path, nice: int = 0) -> None:
        self.where = where
        self._stop = threading.Event()
        self._copied = False
        self._thread = threading.Thread(target=self._run, args=(dict(extra), nice),
                                        name="ijhotcopy", daemon=True)
        self._thread.start()

    def _run(self, extra: dict[str, int], nice: int) -> None:
        try:
            if nice > 0:
                try:
                    raise_own_nice(nice)
                except OSError:  # a priority is a preference
                    pass
            os.mkdir(self.where, 0o700)
            for name, fd in extra.items():
                copy_sparse(fd, self.where / name, self._stop)
            self._copied = True
        except OSError as exc:
            if exc.errno != errno.ECANCELED:
                log.info("the hot tier goes without this snapshot: %s", exc)
        except Exception:  # noqa: BLE001 - a cache: the snapshot is stored either way
            log.exception("copying a snapshot's files for the hot tier")

    def copied(self) -> bool:
        """Waits for the copy: whether every file is in ``where``."""
        self._thread.join()
        return self._copied

    def cancel(self) -> None:
        """Stops the copy and waits for the thread (``where`` is the caller's to remove)."""
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class FileChanges:
    """What a kernel said of its arena file (gpu/file_changes.py): this snapshot's token and,
    where it knows, the earlier snapshot (``since``) whose file this one differs from only in
    the ``changed`` (offset, length) ranges."""

    token: str
    since: str | None = None
    changed: tuple[tuple[int, int], ...] = ()

    MAX_RANGES = 1 << 20

    @classmethod
    def parse(cls, report: object) -> FileChanges | None:
        """From the kernel's report of its segments (gpu_vmm.offload), checked field by field:
        None without a token; no ``since`` where its ranges are not well formed."""
        if not isinstance(report, dict) or not _is_token(report.get("token")):
            return None
        said = report.get("file_changes")
        if not isinstance(said, dict) or not _is_token(said.get("since")):
            return cls(report["token"])
        ranges = said.get("changed")
        if not isinstance(ranges, list) or len(ranges) > cls.MAX_RANGES or not all(
                isinstance(r, (list, tuple)) and len(r) == 2 and
                all(type(v) is int and v >= 0 for v in r) for r in ranges):
            return cls(report["token"])
        return cls(report["token"], said["since"], tuple((r[0], r[1]) for r in ranges))


def _is_token(value: object) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(
        c in "0123456789abcdef" for c in value)


class StoredVersions:
    """The blobs the extra files of the last few snapshots were stored as, by store and the
    kernel's token, with their commit: a snapshot after a small change stores its file from
    the changes only (store/incremental.py: 22-28 s for a 30 GB file read whole). Only what
    this server stored, in memory: after a restart the next snapshot reads its file whole."""

    KEEP = 32

    def __init__(self) -> None:
        self._blobs: OrderedDict[tuple[str, str], tuple[str, dict[str, Blob]]] = OrderedDict()
        self._lock = threading.Lock()

    def base(self, store: str, changes: FileChanges | None, name: str
             ) -> tuple[str, Blob] | None:
        """The stored version of ``name`` that ``changes`` are relative to, if known, with
        the commit that holds it."""
        if changes is None or changes.since is None:
            return None
        with self._lock:
            commit, blobs = self._blobs.get((store, changes.since), ("", {}))
        return (commit, blobs[name]) if name in blobs else None

    def remember(self, store: str, token: str, commit: str, blobs: dict[str, Blob]) -> None:
        with self._lock:
            self._blobs[(store, token)] = (commit, dict(blobs))
            self._blobs.move_to_end((store, token))
            while len(self._blobs) > self.KEEP:
                self._blobs.popitem(last=False)
