"""Named crash points for crash-consistency tests.

``crashpoint("after_pack")`` kills the current process with SIGKILL when the environment
variable ``INFINIJUP_STORE_CRASH_AT`` names that point (``name`` or ``name:N`` to die on the
N-th time the point is reached). Without the variable this is a dictionary lookup; it lets
tests SIGKILL a real commit or gc at exact places between durable steps.
"""

from __future__ import annotations

import os
import signal

ENV = "INFINIJUP_STORE_CRASH_AT"
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
