"""Infinijup: branchable, resumable Jupyter sessions (CPU and GPU state)."""

try:
    from ._version import __version__  # written by the build (from package.json)
except ImportError:  # a source tree that was never built
    try:
        from importlib.metadata import version

        __version__ = version("infinijup")
    except Exception:
        __version__ = "0.0.0+unknown"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "infinijup"}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "infinijup.serverext"}]
