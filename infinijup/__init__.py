"""Infinijup: branchable, resumable Jupyter sessions (CPU and GPU state)."""

from ._version import __version__  # noqa: F401


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "infinijup"}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "infinijup.serverext"}]
