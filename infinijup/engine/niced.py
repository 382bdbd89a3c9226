"""Work done at a lower CPU priority: the store's ingest of an automatic snapshot (issue 30).

After an automatic snapshot's dump the kernel runs on (the user's next cell) while the store
takes the images in, hashing and compressing on every core the writer uses. On a machine of
few cores that work slows the next cells. :func:`run_niced` runs it in a thread of its own
whose nice value is raised: on Linux the nice value belongs to the thread, and threads it
starts (the writer's workers, its pack writers and sealer) inherit it, so the kernel's cells
come first and the ingest takes what they leave. Without privilege a nice value can only be
raised, never lowered again, so each call gets a fresh thread that ends with it; the caller's
thread keeps its own priority.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MAX_NICE = 19
THREAD_NAME = "ijniced"


def raise_own_nice(by: int) -> int:
    """Raise the calling thread's nice value by ``by`` (at most to 19); the value now."""
    tid = threading.get_native_id()
    now = os.getpriority(os.PRIO_PROCESS, tid)
    want = min(MAX_NICE, now + by)
    if want > now:
        os.setpriority(os.PRIO_PROCESS, tid, want)
    return os.getpriority(os.PRIO_PROCESS, tid)


def run_niced(fn: Callable[[], T], by: int) -> T:
    """``fn()`` in a fresh thread ``by`` nice levels below the caller; its result or error.
    ``by`` <= 0: in the caller's thread, as it is."""
    if by <= 0:
        return fn()
    out: dict[str, object] = {}

    def body() -> None:
        try:
            raise_own_nice(by)
        except OSError:  # a priority is a preference: the work runs either way
            pass
        try:  # its name in top -H, ps -L (and for the tests)
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write(THREAD_NAME)
        except OSError:
            pass
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            out["error"] = exc

    thread = threading.Thread(target=body, name=THREAD_NAME, daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]
