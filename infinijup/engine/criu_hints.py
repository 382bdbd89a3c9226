"""What a user can do about a dump that CRIU refused, where the refusal is of a known kind.

CRIU's own words ("Can't create link remap for /dev/shm/sem.EdiK73. Use link-remap option.")
name an option of CRIU, not the notebook's object that caused them. Each known refusal is
told here as what the kernel holds and what to do; any other failure stays as it was.
"""

from __future__ import annotations

import re

from ..errors import InfinijupError, KernelUnsavable

# A POSIX semaphore that glibc made under a temporary name and linked to its real one: the
# mapping names a file that is gone while its inode still has a link, which CRIU saves only as
# a hard link left in /dev/shm (its --link-remap): no image of a snapshot. Python's
# multiprocessing makes these for spawn and forkserver; for fork it unlinks the name at once,
# and CRIU then saves the semaphore's content with the image.
_SEMAPHORE = re.compile(r"Can't create link remap for /dev/shm/sem\.")


def explain(exc: InfinijupError) -> KernelUnsavable | None:
    """The failure said as what the kernel holds and what to do; None: not a known kind."""
    if getattr(exc, "reason", None) == "criu_failed" and _SEMAPHORE.search(str(exc)):
        return KernelUnsavable(
            "snapshot failed: the kernel (or a process it started) holds a multiprocessing "
            "Queue, Lock, Event or Pool made with the 'spawn' or 'forkserver' start method, "
            "whose POSIX semaphore in /dev/shm no snapshot can carry. Close it first "
            "(pool.close(); pool.join(); or queue.close() and del the queue), or make it with "
            "multiprocessing.get_context('fork'), whose semaphores are saved; the kernel was "
            "left running as it was", reason="posix_semaphore")
    return None
