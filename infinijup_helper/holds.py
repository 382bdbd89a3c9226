"""Hold points: where the reliability tests stop the helper, and CRIU, at a named phase.

Inert unless the helper was started with ``INFINIJUP_HELPER_HOLDS=DIR`` (its environment is
root's: nothing a client sends reaches this). A point NAME is armed while the file ``DIR/NAME``
exists: reaching it, the helper writes ``DIR/NAME.reached`` (JSON details, such as CRIU's pid)
and waits until ``DIR/NAME`` is removed. A test kills or stops processes meanwhile, knowing
exactly where the operation is, instead of guessing from a delay.

The points (KIND is ``dump`` or ``restore``):

* ``connection_accepted``: a connection accepted, what its caller's kernels inherit (cgroup,
  resource limits) not read yet;
* ``criu_KIND_request``: CRIU runs, its request is not sent yet;
* ``criu_KIND_ACTION``: inside CRIU, at its own notifications (criu.py answers each):
  ``pre-dump``, ``query-ext-files`` (the tree frozen, nothing dumped yet), ``post-dump``
  (dumped, still frozen); ``pre-restore``, ``post-restore`` (the tree created, not yet
  resumed), ``pre-resume``, ``post-resume``;
* ``criu_KIND_response``: CRIU has answered, the helper has not acted on the answer yet;
* ``lazy_pages_held``: a lazy restore's userfaultfds taken from CRIU's page daemon at
  post-restore, before it has served or streamed a page; ``lazy_pages_renew`` and
  ``lazy_pages_ended`` in the helper's watch of that daemon (lazy_pages.py);
* ``cuda_locked``, ``cuda_checkpointed``, ``cuda_restored``: in the CUDA driver's checkpoint of a
  process (cuda_driver.py), for a dump and for a release or reacquire of a kernel's GPU.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

ENV = "INFINIJUP_HELPER_HOLDS"
POLL_S = 0.005


def _dir() -> str | None:
    return os.environ.get(ENV) or None


def hold(name: str, **details: Any) -> None:
    """Announce ``name`` and wait while it is armed; return at once when it is not."""
    directory = _dir()
    if directory is None:
        return
    point = os.path.join(directory, name)
    if not os.path.exists(point):
        return
    # one temporary name per thread: concurrent operations reach the same point together
    # (four restores at once), and a shared name let one rename away another's file
    tmp = f"{point}.reached.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"name": name, "helper_pid": os.getpid(), **details}, f)
    os.replace(tmp, f"{point}.reached")
    while os.path.exists(point):
        time.sleep(POLL_S)
