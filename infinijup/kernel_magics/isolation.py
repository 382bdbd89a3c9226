"""Keep the kernel's own machinery off the user's interpreter state.

A restored kernel must go on exactly where the snapshot left it. Between the snapshot and the
user's next cell, the kernel answers messages that are ours or the frontend's (kernel_info after
every reconnect, our silent quiesce/resume requests); none of them may move state the user can
observe. What used to:

- IPython's banner, computed for every ``kernel_info`` reply, picks its tip with the global
  ``random.choice``: each reconnect drew from the user's ``random``. The tip now comes from a
  private ``random.Random``.
- jupyter_client's ``Session`` culls its replay-protection digests with ``random.sample`` once
  65536 messages were received. Its module now sees a private ``random.Random``.
- An execute request, even silent and empty, replaces ``get_ipython().last_execution_result``:
  :func:`put_back_last_result` gives the user's last cell its place back.

Installed by the launcher before the kernel starts (and again, harmlessly, by the extension).
"""

from __future__ import annotations

import random
from datetime import datetime

_rng = random.Random()
_last_user_result: tuple[object, bool] | None = None
_tracked_shell: object | None = None


def _pick_tip() -> str:
    """IPython's ``pick_tip``, drawing from our own generator."""
    try:
        from IPython.core import tips

        pool = tips._tips
        today = datetime.now()
        yearly = pool.get("every_year", {})
        if (today.month, today.day) in yearly:
            return yearly[(today.month, today.day)]
        return _rng.choice(pool["random"])
    except Exception:  # IPython moved its tips: no tip rather than a draw from the user's RNG
        return ""


def install() -> None:
    """Point the kernel's own random draws at a private generator (idempotent)."""
    try:
        from IPython.core import interactiveshell

        interactiveshell.pick_tip = _pick_tip
    except ImportError:
        pass
    try:
        from jupyter_client import session

        if session.random is random:
            session.random = _rng
    except (ImportError, AttributeError):
        pass


def _ours(result) -> bool:
    """A result of the empty silent request that carries our agent (or any such request)."""
    info = getattr(result, "info", None)
    return info is not None and bool(info.silent) and not (info.raw_cell or "").strip()


def track_last_result(ip) -> None:  # noqa: ANN001 - IPython's shell
    """Keep, after every execution, the last result that came from a cell of the user."""
    global _last_user_result, _tracked_shell
    if _tracked_shell is ip:
        return
    _tracked_shell = ip
    _last_user_result = (ip.last_execution_result, ip.last_execution_succeeded)

    def remember() -> None:
        global _last_user_result
        result = ip.last_execution_result
        if not _ours(result):
            _last_user_result = (result, ip.last_execution_succeeded)

    ip.events.register("post_execute", remember)


def put_back_last_result(ip) -> None:  # noqa: ANN001 - IPython's shell
    """Undo what our own silent request did to ``last_execution_result``/``_succeeded``."""
    if ip is None or _last_user_result is None or not _ours(ip.last_execution_result):
        return
    ip.last_execution_result, ip.last_execution_succeeded = _last_user_result
