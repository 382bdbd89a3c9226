"""What the server calls inside the kernel, as a silent execute request.

The server sends ``user_expressions`` that call :func:`quiesce` or :func:`resume`; the result is
a JSON string, so the server needs nothing from IPython to read it.
"""

from __future__ import annotations

import json

from . import hooks


def _execution_count() -> int | None:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return int(ip.execution_count) - 1 if ip is not None else None
    except Exception:
        return None


def quiesce() -> str:
    """Bring the kernel to a point safe to freeze; report its execution count."""
    info = hooks.run_quiesce()
    info["execution_count"] = _execution_count()
    return json.dumps(info)


def resume(restored: bool = False) -> str:
    info = hooks.run_resume(bool(restored))
    info["execution_count"] = _execution_count()
    return json.dumps(info)


def expression(name: str, *args: object) -> str:
    """The user expression that calls ``name(*args)`` in this module (for the server)."""
    call_args = ", ".join(repr(a) for a in args)
    return f"__import__('infinijup.kernel_magics.agent', fromlist=['_']).{name}({call_args})"
