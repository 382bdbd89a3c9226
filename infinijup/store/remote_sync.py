"""Background push of new commits to a remote, and eviction under a local budget.

``RemoteSync`` owns one worker thread. ``request(thread)`` only notes the thread and wakes the
worker: it never blocks and never fails, so a snapshot does not wait for the network. The
worker pushes the noted threads one push at a time (requests made meanwhile coalesce into the
next pass); on the first pass it pushes every local thread, so commits made while no server
ran go too. A failure (the remote unreachable, refused credentials, a missing bucket) is
logged with the remote's one-line message (never a credential: s3.py) and retried after a
delay that doubles from ``retry_min`` up to ``retry_max``; the threads stay queued. A thread
that another writer moved on the remote (``RemoteConflict``) is not retried until it gets a
new commit. After a pass that pushed everything, ``evict`` (tiers.py) brings the store under
the local budget, when one is set.

The remote is opened once, with ``creds`` (default: the environment's, keys.py:
``$INFINIJUP_STORE_PASSWORD_FILE`` or ``$INFINIJUP_STORE_KEY_FILE`` for an encrypted remote,
``$INFINIJUP_REMOTE_UNENCRYPTED=1`` to allow one without encryption), and kept: the key is
derived once per server, and adding, removing or changing key slots meanwhile does not
disturb it (the master key does not change). A missing or wrong key is a failure like any
other: logged with its reason, retried.

Restores pin the commit they read (``pinned``) so that an eviction does not take its chunks
meanwhile. ``status()`` is a JSON-able summary for the server's status route.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import RemoteConflict, StoreLocked, UnknownRef
from .keys import Credentials
from .remote import push
from .remote_repo import RemoteRepo, open_remote
from .repository import Repository
from .s3 import parse_url
from .tiers import evict, store_bytes

log = logging.getLogger(__name__)


class RemoteSync:
    """Pushes a store's threads to ``url`` in the background (see the module docs)."""

    def __init__(self, store_path: str | Path, url: str, *,
                 budget: Callable[[], int] = lambda: 0,
                 preferred: Callable[[], set[str]] = set,
                 retry_min: float = 1.0, retry_max: float = 300.0,
                 logger: logging.Logger | logging.LoggerAdapter | None = None,
                 creds: Credentials | None = None) -> None:
        self.url = str(parse_url(url))  # a bad URL fails here, at start-up
        self.creds = Credentials.from_env() if creds is None else creds
        self._remote: RemoteRepo | None = None
        self.store_path = Path(store_path)
        self.budget = budget
        self.preferred = preferred
        self.retry_min, self.retry_max = retry_min, max(retry_min, retry_max)
        self.log = logger or log
        self._cond = threading.Condition()
        self._pending: set[str] = set()
        self._inflight: set[str] = set()  # taken by the pass that runs now
        self._all = True  # the first pass pushes every local thread
        self._evict_due = False
        self._busy = ""  # "pushing" / "evicting" while the worker works
        self._retry_at = 0.0
        self._delay = retry_min
        self._pinned: Counter[str] = Counter()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._manifests: dict[str, list[str]] = {}
        self.pushed: dict[str, str] = {}  # thread -> its tip on the remote, as last pushed
        self.conflicts: dict[str, str] = {}  # thread -> why it was not pushed
        self.last_push: dict | None = None
        self.last_error: dict | None = None
        self.last_eviction: dict | None = None
        self.local_bytes: int | None = None

    # --- what the server calls -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="infinijup-remote-sync",
                                        daemon=True)
        self._thread.start()

    def request(self, thread: str) -> None:
        """Push ``thread`` soon (a new commit is on it)."""
        with self._cond:
            self._pending.add(thread)
            self.conflicts.pop(thread, None)
            self._cond.notify_all()

    @contextlib.contextmanager
    def pinned(self, commit_id: str) -> Iterator[None]:
        """No eviction takes ``commit_id``'s chunks while this is held."""
        with self._cond:
            self._pinned[commit_id] += 1
        try:
            yield
        finally:
            with self._cond:
                self._pinned[commit_id] -= 1
                if self._pinned[commit_id] <= 0:
                    del self._pinned[commit_id]

    def evict_soon(self) -> None:
        """Check the local budget again (it changed)."""
        with self._cond:
            self._evict_due = True
            self._cond.notify_all()

    def is_pushed(self, commit_id: str | None) -> bool:
        """Whether ``commit_id`` is a tip this server saw on the remote."""
        with self._cond:
            return commit_id is not None and commit_id in self.pushed.values()

    def wait_idle(self, timeout: float) -> bool:
        """Push what is queued now, without waiting out a retry delay, and wait until nothing
        is queued or being pushed (True). False after ``timeout``, or as soon as a push made
        meanwhile fails (a stopping server does not wait for a remote that is down)."""
        deadline = time.monotonic() + timeout
        since = time.time()
        with self._cond:
            self._retry_at = 0.0
            self._cond.notify_all()
            while self._pending or self._all or self._busy == "pushing":
                left = deadline - time.monotonic()
                failed = self.last_error is not None and self.last_error["at"] >= since
                if left <= 0 or failed or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 1.0))
            return True

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def status(self) -> dict:
        with self._cond:
            now = time.monotonic()
            waiting = bool(self._pending or self._all) and self._retry_at > now
            state = self._busy or ("retrying" if waiting else
                                   "queued" if self._pending or self._all else "idle")
            return {"url": self.url, "state": state,
                    "pending": sorted(self._pending | self._inflight),
                    "retry_in": round(self._retry_at - now, 1) if waiting else None,
                    "pushed": dict(self.pushed), "conflicts": dict(self.conflicts),
                    "last_push": self.last_push, "last_error": self.last_error,
                    "local_budget": self.budget() or None, "local_bytes": self.local_bytes,
                    "last_eviction": self.last_eviction}

    # --- the worker ----------------------------------------------------------------------
    def _run(self) -> None:
        repo: Repository | None = None
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._ready():
                        wait = self._retry_at - time.monotonic()
                        self._cond.wait(wait if self._has_work() and wait > 0 else None)
                    if self._stopping:
                        return
                    names, everything = set(self._pending), self._all
                    self._inflight = set(names)
                    self._pending.clear()
                    self._all = self._evict_due = False
                    self._busy = "pushing"
                try:
                    if repo is None:
                        repo = Repository.open_or_init(self.store_path)
                    if everything:
                        names |= set(repo.threads())
                        with self._cond:
                            self._inflight = set(names)
                    ok = self._push(repo, names)
                    if ok and self.budget() > 0:
                        self._evict(repo)
                except Exception as exc:  # noqa: BLE001 - the worker must go on
                    self._failed(f"{type(exc).__name__}: {exc}", "internal_error", names,
                                 everything)
                finally:
                    with self._cond:
                        self._busy = ""
                        self._inflight = set()
                        self._cond.notify_all()
        finally:
            if repo is not None:
                repo.close()

    def _has_work(self) -> bool:
        return bool(self._pending or self._all or self._evict_due)

    def _ready(self) -> bool:
        return self._has_work() and time.monotonic() >= self._retry_at

    def remote(self) -> RemoteRepo:
        """The remote, opened on first use (its key derived once)."""
        if self._remote is None:
            self._remote = open_remote(self.url, self.creds)
        return self._remote

    def _push(self, repo: Repository, names: set[str]) -> bool:
        """Push each thread; False (all of them queued again) on a failure to retry."""
        todo = sorted(names)
        for i, name in enumerate(todo):
            try:
                report = push(repo, self.remote(), [name])
            except UnknownRef:  # the thread was deleted meanwhile
                with self._cond:
                    self._inflight.discard(name)
                continue
            except RemoteConflict as exc:
                with self._cond:
                    self.conflicts[name] = exc.message
                    self._inflight.discard(name)
                self.log.warning("infinijup: thread %r was not pushed to %s: %s", name,
                                 self.url, exc.message)
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is retried later
                reason = getattr(exc, "reason", "internal_error")
                message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                self._failed(message, reason, set(todo[i:]), False)
                return False
            with self._cond:  # one step: a status never shows it pushed and still failing
                self.pushed.update(report.threads)
                self._inflight.discard(name)
                self.last_push = {"at": time.time(), "threads": dict(report.threads),
                                  "packs": report.packs_uploaded,
                                  "bytes": report.bytes_uploaded,
                                  "commits": report.commits_uploaded}
                recovered, self.last_error = self.last_error is not None, None
                self._delay = self.retry_min
            if recovered:
                self.log.info("infinijup: pushes to %s work again", self.url)
            if report.commits_uploaded:
                self.log.info("infinijup: pushed %s to %s (%d commits, %d bytes)", name,
                              self.url, report.commits_uploaded, report.bytes_uploaded)
        return True

    def _failed(self, message: str, reason: str, names: set[str], everything: bool) -> None:
        with self._cond:
            self._pending |= names
            self._inflight -= names
            self._all = self._all or everything
            self._retry_at = time.monotonic() + self._delay
            retry_in = self._delay
            self._delay = min(self._delay * 2, self.retry_max)
            first = self.last_error is None or self.last_error["message"] != message
            self.last_error = {"at": time.time(), "message": message, "reason": reason,
                               "retry_in": retry_in}
        log_at = self.log.warning if first else self.log.debug
        log_at("infinijup: background push to %s failed (%s); retrying in %.0f s", self.url,
               message, retry_in)

    def _evict(self, repo: Repository) -> None:
        with self._cond:
            self._busy = "evicting"
            pinned = set(self._pinned)
        budget = self.budget()
        try:
            preferred = set(self.preferred()) | set(repo.threads().values())
            report = evict(repo, self.remote(), budget, pinned=pinned, preferred=preferred,
                           manifests=self._manifests)
        except StoreLocked:  # a snapshot is being written: after it, or a while
            with self._cond:
                self._evict_due = True
                self._retry_at = time.monotonic() + self.retry_min
            return
        except Exception as exc:  # noqa: BLE001 - logged; the next pass tries again
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            self.log.warning("infinijup: eviction to the local budget failed: %s", message)
            with self._cond:
                self.last_eviction = {"at": time.time(), "error": message}
            return
        finally:
            self.local_bytes = store_bytes(repo)
        if report.commits:
            self.log.info("infinijup: %d commits are remote-only now (%s); the store went from "
                          "%d to %d bytes (budget %d)", len(report.commits), self.url,
                          report.bytes_before, report.bytes_after, budget)
        with self._cond:
            self.last_eviction = {"at": time.time(), **report.to_json()}
            self._cond.notify_all()


__all__ = ["RemoteSync"]
