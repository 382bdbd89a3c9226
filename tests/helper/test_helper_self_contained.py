"""The helper imports nothing of the ``infinijup`` package (the user's side): root runs only
``infinijup_helper/`` of the checkout (scripts/install_helper.py copies nothing else of it)."""

from __future__ import annotations

import ast
import subprocess

from helperkit import PYTHON, REPO


def _imports(path) -> list[str]:
    """Every module a file imports, at its top or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append(node.module or "")
    return out


def test_no_module_of_the_helper_imports_infinijup() -> None:
    found = [f"{path.name}: {name}" for path in sorted((REPO / "infinijup_helper").glob("*.py"))
             for name in _imports(path) if name == "infinijup" or name.startswith("infinijup.")]
    assert found == []


def test_importing_the_helper_loads_nothing_of_infinijup() -> None:
    code = ("import sys\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            "import infinijup_helper.__main__, infinijup_helper.ops, infinijup_helper.cuda_stage\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'infinijup'))\n")
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
