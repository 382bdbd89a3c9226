"""Named crash points and hold points for crash-consistency tests.

``crashpoint("after_pack")`` kills the current process with SIGKILL when the environment
variable ``INFINIJUP_STORE_CRASH_AT`` names that point (``name`` or ``name:N`` to die on the
N-th time the point is reached). Without the variable this is a dictionary lookup; it lets
tests SIGKILL a real commit or gc at exact places between durable steps.

``holdpoint("before_ingest")`` waits there while a test holds it: with
``INFINIJUP_STORE_HOLDS=DIR``, the point NAME is armed while ``DIR/NAME`` exists; reaching it,
the process writes ``DIR/NAME.reached`` and waits until ``DIR/NAME`` is removed (the protocol
of the helper's hold points, infinijup_helper/holds.py). Inert without the variable.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "INFINIJUP_STORE_CRASH_AT"
HOLDS_ENV = "INFINIJUP_STORE_HOLDS"
_hits: dict[str, int] = {}


def crashpoint(name: str) -> None:
    """Die with SIGKILL here if ``$INFINIJUP_STORE_CRASH_AT`` names this point."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, _, nth = spec.partition(":")
    if want != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def holdpoint(name: str) -> None:
    """Wait here while ``$INFINIJUP_STORE_HOLDS/<name>`` exists (see the module docs)."""
    directory = os.environ.get(HOLDS_ENV)
    if not directory:
        return
    point = os.path.join(directory, name)
    if not os.path.exists(point):
        return
    tmp = f"{point}.reached.{os.getpid()}.{threading.get_ident()}.tmp"  # threads meet here too
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, f"{point}.reached")
    while os.path.exists(point):
        time.sleep(0.005)
