"""The trees this helper started or restored: the only processes it acts on for a user.

A user's request names a pid. The helper never decides from ``/proc`` (a command line, a uid,
a namespace) whether that pid is one of its kernel trees: any user can make a process that
looks like one. It keeps its own record instead, made when it spawned or restored the tree:
pid, start time (the pair names one process for the life of the machine), owner uid, and a
pidfd held for as long as the tree lives.

An op *holds* the tree for its whole length (:meth:`Registry.hold`). While a tree is held the
reaper does not reap it, so a tree that is the helper's child keeps its pid (as a zombie, if
it dies) until the op is over: the pid an op passes to CRIU or to the CUDA driver cannot be
recycled underneath it. Trees that are not the helper's children (adopted from a previous
helper instance) are checked through their pidfd after the fact instead (see ops.py).

The record is kept in a file only root can write, ``<socket>.trees.json`` beside the
helper's socket (on /run: trees do not outlive a reboot either), rewritten on each change,
with the boot's id (``/proc/sys/kernel/random/boot_id``): pid and start time name one process
for one boot only, so a file written during another boot (a socket dir that persists across
reboots) is forgotten, its trees not adopted. A helper that restarts (after a crash, say in
the middle of a restore) still knows, by pid *and* start time, which trees are whose; and a Jupyter server whose helper died while CRIU was
restoring its kernel finds the restored tree there (infinijup/engine/orphans.py): nothing
else, no command line, no uid in /proc, is trusted for that. It is world-readable: it holds
pids, start times and uids, which /proc shows everyone anyway.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import select
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from .holds import hold
from .protocol import RequestError

log = logging.getLogger(__name__)

REGISTRY_SUFFIX = ".trees.json"  # appended to the socket path
KEEP_EXITED = 4096


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot); None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[19])


def pidfd_alive(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)


@dataclass
class Tree:
    pid: int
    start: int
    owner: int
    namespace: bool
    pidfd: int
    child: bool  # the helper's child: it reaps it, and its pid is pinned until then
    holds: int = 0
    exited: bool = False  # seen exited while held: reaped when the last hold goes
    reaping: bool = False  # the reaper is at it (its pidfd about to close): not to be held

    def alive(self) -> bool:
        return pidfd_alive(self.pidfd)

    def as_json(self) -> dict:
        return {"pid": self.pid, "start": self.start, "owner": self.owner,
                "namespace": self.namespace}


@dataclass(frozen=True)
class ExitRecord:
    pid: int
    owner_uid: int
    exit_code: int | None  # negative: killed by that signal


@dataclass
class Held:
    """A tree an op holds: reaping waits until the op is done."""

    tree: Tree
    registry: Registry
    done: bool = field(default=False)

    @property
    def pid(self) -> int:
        return self.tree.pid

    @property
    def pidfd(self) -> int:
        return self.tree.pidfd

    def alive(self) -> bool:
        return self.tree.alive()

    def ensure_alive(self) -> None:
        if not self.alive():
            raise RequestError("no_such_process", f"the tree of {self.pid} has exited")

    def reap(self) -> ExitRecord | None:
        """Reap the (exited) root now, from inside the op that holds it."""
        return self.registry._reap(self.tree.pid, force=True)


class Registry:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._trees: dict[int, Tree] = {}
        self._exited: collections.OrderedDict[int, ExitRecord] = collections.OrderedDict()
        self.wake = lambda: None  # set by the reaper: something to poll changed

    # --- recording --------------------------------------------------------------------------

    def add(self, pid: int, owner: int, *, child: bool = True) -> Tree:
        """Record a tree the helper just spawned or restored."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise RequestError("no_such_process", f"the new tree {pid} exited at once") from None
        start = start_time(pid)
        if start is None:
            os.close(pidfd)
            raise RequestError("no_such_process", f"the new tree {pid} exited at once")
        tree = Tree(pid=pid, start=start, owner=owner, namespace=_is_namespace_init(pid),
                    pidfd=pidfd, child=child)
        with self._lock:
            old = self._trees.pop(pid, None)
            if old is not None:
                os.close(old.pidfd)
            self._exited.pop(pid, None)
            self._trees[pid] = tree
            self._save_locked()
        self.wake()
        return tree

    def load(self) -> list[Tree]:
        """Adopt the trees a previous helper instance recorded that still run (same pid and
        start time); forget the rest. Returns the adopted trees."""
        if not self.path:
            return []
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != 0 or st.st_mode & 0o022:
                raise RuntimeError(f"{self.path} must be owned by root and writable by nobody else")
            raw = f.read(16 << 20)
        try:
            recorded = json.loads(raw)
            entries = recorded["trees"]
        except (ValueError, KeyError, TypeError):
            log.warning("%s is unreadable; no trees adopted", self.path)
            recorded, entries = {}, []
        other_boot = _other_boot(recorded, st.st_mtime)
        if other_boot and entries:
            # pid and start time name one process for one boot only: after a reboot they may
            # name anybody's process
            log.warning("%s was written %s: its %d trees are forgotten, none adopted",
                        self.path, other_boot, len(entries))
            entries = []
        adopted = []
        for entry in entries:
            try:
                pid, start, owner = int(entry["pid"]), int(entry["start"]), int(entry["owner"])
            except (KeyError, TypeError, ValueError):
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except (ProcessLookupError, OSError):
                continue
            # The pidfd was taken first: if the start time read now matches, it names the
            # process that was recorded, not a newer one that reuses its pid.
            if start_time(pid) != start or not pidfd_alive(pidfd):
                os.close(pidfd)
                continue
            tree = Tree(pid=pid, start=start, owner=owner, namespace=_is_namespace_init(pid),
                        pidfd=pidfd, child=_ppid(pid) == os.getpid())
            adopted.append(tree)
        with self._lock:
            for tree in adopted:
                self._trees[tree.pid] = tree
            self._save_locked()
        for tree in adopted:
            log.info("adopted tree %d of uid %d (recorded by a previous helper)", tree.pid,
                     tree.owner)
        return adopted

    def _save_locked(self) -> None:
        if not self.path:
            return
        directory, name = os.path.split(self.path)
        tmp = f".{name}.{os.getpid()}.tmp"
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dir_fd)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump({"v": 1, "boot_id": boot_id(),
                           "trees": [t.as_json() for t in self._trees.values()]}, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    # --- ops' view --------------------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, caller_uid: int, pid: int) -> Iterator[Held]:
        """The tree ``pid`` if the caller owns it (root owns all), held until the block ends.

        Raises ``no_such_process`` for a pid that is not a live tree of this helper (whatever
        the process behind it looks like), ``permission_denied`` for another user's tree.
        """
        with self._lock:
            tree = self._trees.get(pid)
            if tree is None or tree.exited or tree.reaping:
                raise RequestError(
                    "no_such_process",
                    f"{pid} is not a kernel tree this helper runs (spawned or restored by it)")
            if caller_uid != 0 and tree.owner != caller_uid:
                raise RequestError("permission_denied",
                                   f"process {pid} does not belong to uid {caller_uid}")
            tree.holds += 1
        held = Held(tree, self)
        try:
            yield held
        finally:
            with self._lock:
                tree.holds -= 1
                release = tree.holds == 0 and tree.exited
            if release:
                self.wake()

    def lookup(self, pid: int) -> Tree | None:
        with self._lock:
            return self._trees.get(pid)

    def owned_by(self, uid: int | None) -> list[Tree]:
        """Live trees of ``uid`` (None: everyone's)."""
        with self._lock:
            return [t for t in self._trees.values()
                    if (uid is None or t.owner == uid) and not t.exited]

    def exit_record(self, pid: int) -> ExitRecord | None:
        with self._lock:
            return self._exited.get(pid)

    def wait_gone(self, pid: int, timeout: float) -> ExitRecord | None:
        """Block until ``pid`` is no longer a live tree; its exit record if one was kept."""
        with self._lock:
            self._changed.wait_for(lambda: pid not in self._trees, timeout)
            return self._exited.get(pid)

    # --- the reaper's view ------------------------------------------------------------------

    def watched(self) -> dict[int, int]:
        """pidfd -> pid of every tree to poll (held trees that exited wait for their op)."""
        with self._lock:
            return {t.pidfd: t.pid for t in self._trees.values() if not t.exited}

    def released(self) -> list[int]:
        """Trees that exited while held and are no longer held: to be reaped now."""
        with self._lock:
            return [t.pid for t in self._trees.values() if t.exited and t.holds == 0]

    def exited(self, pid: int) -> None:
        """The reaper saw ``pid``'s pidfd readable."""
        self._reap(pid, force=False)

    def _reap(self, pid: int, *, force: bool) -> ExitRecord | None:
        with self._lock:
            tree = self._trees.get(pid)
            if tree is None:
                return self._exited.get(pid)
            if tree.holds and not force:
                tree.exited = True  # the op holding it decides; the pid stays pinned meanwhile
                return None
            if tree.reaping:
                return None  # (another thread is at it)
            tree.reaping = True  # from now on no op may hold it (hold), its pidfd closes
        hold("tree_reaping", pid=pid)
        code: int | None = None
        alive = True  # (until seen otherwise)
        try:
            if tree.child:
                try:
                    result = os.waitid(os.P_PIDFD, tree.pidfd, os.WEXITED | os.WNOHANG)
                except ChildProcessError:
                    result = None
                alive = result is None and pidfd_alive(tree.pidfd)
                if result is not None:
                    code = (result.si_status if result.si_code == os.CLD_EXITED
                            else -result.si_status)
            else:
                alive = pidfd_alive(tree.pidfd)
        finally:
            if alive:  # not exited after all (or the look failed): as it was
                with self._lock:
                    tree.reaping = False
        if alive:
            return None
        record = ExitRecord(pid, tree.owner, code)
        with self._lock:
            if self._trees.get(pid) is tree:
                del self._trees[pid]
            self._exited[pid] = record
            self._exited.move_to_end(pid)
            while len(self._exited) > KEEP_EXITED:
                self._exited.popitem(last=False)
            self._save_locked()
            self._changed.notify_all()
        os.close(tree.pidfd)
        log.info("tree %d of uid %d ended (exit %s)", pid, tree.owner, code)
        return record


def boot_id() -> str | None:
    """This boot's random id (``/proc/sys/kernel/random/boot_id``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def boot_time() -> float | None:
    """When this boot began (``btime`` of /proc/stat, seconds since the epoch)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _other_boot(recorded: object, mtime: float) -> str | None:
    """Why a registry file was written during another boot than this one, or None.

    Its ``boot_id``, where it has one; a file of a helper that did not record it counts as
    of this boot only if it was written after this boot began."""
    recorded_id = recorded.get("boot_id") if isinstance(recorded, dict) else None
    if isinstance(recorded_id, str) and recorded_id:
        current = boot_id()
        if current is not None and recorded_id != current:
            return f"during another boot (boot id {recorded_id}, now {current})"
        return None
    began = boot_time()
    if began is not None and mtime < began:
        return "before this boot began (and records no boot id)"
    return None


def _is_namespace_init(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    return len(ids) >= 2 and ids[-1] == "1"
    except OSError:
        pass
    return False


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
