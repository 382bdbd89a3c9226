"""Names: which store thread holds which notebook thread.

One store holds every notebook's history. A notebook's threads are store threads prefixed with a
key derived from the notebook's path, so two notebooks may each have a ``main``.
"""

from __future__ import annotations

import hashlib
import re

from ..errors import BadRequest

THREAD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_THREAD = "main"
_SEP = "--"


def notebook_key(path: str) -> str:
    """A stable key for a notebook path (its session path, relative to the server root)."""
    return "nb-" + hashlib.sha256(path.encode()).hexdigest()[:16]


def check_thread_name(name: str) -> str:
    if not isinstance(name, str) or not THREAD_RE.match(name) or _SEP in name:
        raise BadRequest(
            f"invalid thread name {name!r}: use letters, digits, '.', '_' or '-' "
            "(up to 64, not starting with a symbol, no '--')",
            reason="bad_thread_name",
        )
    return name


def store_thread(key: str, thread: str) -> str:
    return f"{key}{_SEP}{thread}"


def notebook_threads(all_threads: dict[str, str], key: str) -> dict[str, str]:
    """The notebook's threads (without the prefix) from the store's whole ref table."""
    prefix = key + _SEP
    return {name[len(prefix):]: cid for name, cid in all_threads.items() if name.startswith(prefix)}


def auto_thread_name(base: str, taken: set[str]) -> str:
    """A new thread name next to ``base``: ``main-1``, ``main-2``, ..."""
    stem = re.sub(r"-\d+$", "", base) or DEFAULT_THREAD
    n = 1
    while f"{stem}-{n}" in taken:
        n += 1
    return f"{stem}-{n}"
