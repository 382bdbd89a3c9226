"""kernel_magics/after_import.py, in this process (no kernel, no helper): real modules written
to a temporary directory and imported, or already imported."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from infinijup.kernel_magics import after_import as hooks
from infinijup.kernel_magics.after_import import after_import


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path; the modules imported from it are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _name() -> str:
    return f"ij_after_{uuid.uuid4().hex[:10]}"  # hooks run once per name: fresh in every test


def _module(where: Path, name: str, body: str = "VALUE = 42\n") -> Path:
    path = where.joinpath(*name.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    importlib.invalidate_caches()
    return path


def _finder_installed() -> bool:
    return any(isinstance(f, hooks._Finder) for f in sys.meta_path)


def test_runs_once_right_after_the_module_is_imported(where: Path) -> None:
    name = _name()
    _module(where, name, "VALUE = 42\nSEEN_BY_HOOK = None\n")
    seen: list[ModuleType] = []

    def hook(module: ModuleType) -> None:
        module.SEEN_BY_HOOK = module.VALUE  # the module's body has run
        seen.append(module)

    after_import(name, hook)
    after_import(name, hook)  # armed twice: still one call
    assert seen == [] and name not in sys.modules and _finder_installed()
    module = importlib.import_module(name)
    assert seen == [module] and module.SEEN_BY_HOOK == 42
    # the module sees its real loader, and nothing is left waiting
    assert isinstance(module.__loader__, importlib.machinery.SourceFileLoader)
    assert module.__spec__.loader is module.__loader__
    assert not _finder_installed() and name not in hooks._waiting
    after_import(name, hook)  # imported and already run: not again
    importlib.reload(module)
    assert seen == [module]


def test_an_imported_module_runs_the_hook_at_once(where: Path) -> None:
    name = _name()
    _module(where, name)
    module = importlib.import_module(name)
    seen: list[ModuleType] = []
    after_import(name, seen.append)
    assert seen == [module]
    after_import(name, seen.append)
    assert seen == [module] and not _finder_installed()


def test_a_submodule_of_a_package_and_two_hooks(where: Path) -> None:
    package = _name()
    name = f"{package}.v1.engine.async_llm"  # nested like vLLM's
    _module(where, name, "class AsyncLLM:\n    pass\n")
    for d in ("", "/v1", "/v1/engine"):
        (where / f"{package}{d}" / "__init__.py").write_text("")
    first: list[ModuleType] = []
    second: list[str] = []
    after_import(name, first.append)
    after_import(name, lambda m: second.append(m.AsyncLLM.__name__))
    importlib.import_module(f"{package}.v1")  # the parents alone do not run it
    assert first == [] and second == []
    module = importlib.import_module(name)
    assert first == [module] and second == ["AsyncLLM"]


def test_waits_on_across_an_import_that_fails(where: Path) -> None:
    name = _name()
    _module(where, name, "raise RuntimeError('broken for now')\n")
    seen: list[ModuleType] = []
    after_import(name, seen.append)
    with pytest.raises(RuntimeError, match="broken for now"):
        importlib.import_module(name)
    assert seen == [] and name not in sys.modules and _finder_installed()
    _module(where, name, "VALUE = 'fixed'\n")
    module = importlib.import_module(name)
    assert seen == [module] and module.VALUE == "fixed" and not _finder_installed()


def test_a_failing_hook_does_not_fail_the_import(where: Path) -> None:
    name = _name()
    _module(where, name)
    seen: list[ModuleType] = []

    def broken(module: ModuleType) -> None:
        raise ValueError("hook bug")

    after_import(name, broken)
    after_import(name, seen.append)
    with pytest.warns(RuntimeWarning, match="hook bug"):
        module = importlib.import_module(name)
    assert module.VALUE == 42 and seen == [module]


def test_a_module_not_there_yet_is_hooked_once_it_is(where: Path) -> None:
    name = _name()
    seen: list[ModuleType] = []
    after_import(name, seen.append)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
    assert seen == [] and _finder_installed()
    _module(where, name)  # installed later: the hook is still armed
    module = importlib.import_module(name)
    assert seen == [module] and not _finder_installed()
