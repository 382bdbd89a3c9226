"""A package's names imported where first used (PEP 562), not with the package.

A process that needs one module of a package (the store's serving process, started for
restores: engine/store_pages.py) then does not pay for the package's other modules.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_names(package: str, where: dict[str, str],
               namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: each name in ``where`` from its module (relative to
    ``package``), kept in ``namespace`` once imported."""

    def __getattr__(name: str) -> Any:  # noqa: ANN401 - any of the package's names
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{where[name]}", package), name)
        namespace[name] = value
        return value

    return __getattr__
