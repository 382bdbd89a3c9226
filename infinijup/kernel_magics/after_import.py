"""``after_import(name, callback)``: run code once a module is imported, without importing it.

The kernel arms hooks at its start for modules the user may import later (PyTorch for
gpu_vmm.py, vLLM's AsyncLLM for engines_vllm.py) and must not import them itself. If the
module is already in ``sys.modules``, ``callback(module)`` runs at once. Otherwise one finder
at the head of ``sys.meta_path`` (installed while some hook waits, removed after) finds the
module's spec through the finders behind it, as the import system would, and gives it a
loader that runs the module's code with the real loader, then the callbacks: they run right
after the module's body, before the ``import`` statement that loaded it returns. The module
itself sees only its real loader (``__loader__``, ``__spec__.loader``).

Each (name, callback) pair runs at most once: arming twice is harmless. A callback that
raises after an import does not fail the import (a ``RuntimeWarning`` says so); one that
raises when run at once raises to the caller. An import that fails leaves its hooks waiting
for the next attempt.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], Any]

_lock = threading.Lock()
_waiting: dict[str, list[Callback]] = {}  # module name -> callbacks not run yet
_ran: set[tuple[str, Callback]] = set()


def after_import(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it already is, else
    right after its body has run (see the module docs)."""
    with _lock:
        if (name, callback) in _ran or callback in _waiting.get(name, ()):
            return
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
        _ran.add((name, callback))
    callback(module)


def _imported(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
        _ran.update((name, cb) for cb in callbacks)
        if not _waiting and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for cb in callbacks:
        try:
            cb(module)
        except Exception as exc:  # the user's import goes on
            warnings.warn(f"infinijup: the hook run after importing {name} failed: {exc!r}",
                          RuntimeWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname not in _waiting:
            return None
        for finder in list(sys.meta_path):  # the finders behind this one, in order
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    """Runs the module with its real loader (which the module is given back), then hooks."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader = loader
        self.name = name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The import system calls spec.loader.exec_module (this) and does not look at the
        # loader again: from here on the module and its spec name the real one.
        module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        self.loader.exec_module(module)
        _imported(self.name, module)


_FINDER = _Finder()

__all__ = ["after_import"]
