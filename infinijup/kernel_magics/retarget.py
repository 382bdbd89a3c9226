"""Kernel side of restoring into another session (see infinijup/engine/retarget.py).

Called by the server right after such a restore, as a silent user expression: it touches only
Infinijup's own variable, none of the user's objects, no execution count, no output.
"""

from __future__ import annotations

import json
import os

from .. import config


def adopt(kernel_id: str) -> str:
    os.environ[config.KERNEL_ID_ENV] = kernel_id  # %snapshot names this kernel from now on
    return json.dumps({"kernel_id": kernel_id})
