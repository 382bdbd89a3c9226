"""A restore's largest file, checked out of the store behind the rest of its images.

A GPU kernel's images are mostly its segments file (30 GB for a 13 B model), and the process
does not read it until its resume hooks copy it back onto the GPU. Where no running kernel is
replaced (a wake from hibernation, a resume into a new kernel), the restore need not wait for
it: CRIU's restore, the driver's and the first answer go on while a thread checks it out, and
the server tells the kernel where it is once it is all there and verified (restore_flow.py).
If it cannot be read, the restored kernel is ended; its snapshot is as it was. A restore in
place checks every file out first: it ends the running kernel, and a damaged chunk found after
that would lose it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from ..errors import InfinijupError, RestoreFailed
from ..store.checkout import Materializer
from ..store.objects import TreeEntry


class FileBehind:
    """``entry`` of a commit's tree being written at ``path`` by a thread of its own."""

    def __init__(self, repo, entry: TreeEntry, path: Path) -> None:  # noqa: ANN001
        self.path, self.name = path, entry.name
        self.seconds: float | None = None
        self._future: Future[Path] = Future()
        self._held: list[contextlib.AbstractContextManager] = []
        self._ended = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(repo, entry),
                                        name="ij-file-behind", daemon=True)
        self._thread.start()

    def hold(self, held: contextlib.AbstractContextManager) -> None:
        """Keep ``held`` (entered: the remote sync's pin of the commit) until the file is
        written or has failed."""
        with self._lock:
            if not self._ended:
                self._held.append(held)
                return
        held.__exit__(None, None, None)

    def _run(self, repo, entry: TreeEntry) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        try:
            with Materializer(repo) as m:
                m.file(entry, self.path)
            self.seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - raised where it is awaited
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._end(exc)
            return
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        """Let go of what was held for the file, then say how it ended."""
        with self._lock:
            self._ended = True
            held, self._held = self._held, []
        for h in held:
            try:
                h.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the file's end is said whatever a pin does
                pass
        if exc is None:
            self._future.set_result(self.path)
        else:
            self._future.set_exception(exc)

    async def done(self) -> Path:
        """Once the file is all there and verified: its path; else why not, as RestoreFailed."""
        try:
            return await asyncio.wrap_future(self._future)
        except InfinijupError as exc:
            raise RestoreFailed(f"restore failed: the snapshot's {self.name} "
                                f"cannot be read from the store ({exc.message}); the restored "
                                "kernel was ended, the snapshot is as it was; `infinijup store "
                                "check --read-data` names the damage", reason=exc.reason) from exc
        except OSError as exc:
            raise RestoreFailed(f"restore failed: cannot check {self.name} out into "
                                f"{self.path.parent}: {exc.strerror or exc}; the restored kernel "
                                "was ended", reason="checkout_failed") from exc

    async def settled(self) -> None:
        """Wait for the thread's end, whatever it was (before the file is removed)."""
        await asyncio.to_thread(self._thread.join)
