"""Install the privileged helper where only root can change it: ``sudo make helper`` runs this.

Root must never run code that another account can write: not the checkout, not its ``.venv``
(a clone in a user's home belongs to that user). So the helper and everything it imports are
copied to ``PREFIX`` (default ``/opt/infinijup/helper``), root-owned, directories 0755 and files
0644, and the daemon runs from there:

    PREFIX/bin/infinijup-helper        the entry point (``python -I``, PREFIX/lib first)
    PREFIX/lib/infinijup_helper/       the helper (nsinit.py included: every tree runs a copy
                                       the helper puts in its work dir; cuda_driver.py and
                                       cuda_preflight.py for its CUDA stage)
    PREFIX/lib/google/protobuf/        pycriu's dependency (pycriu itself: the CRIU prefix)
    PREFIX/lib/cuda/, pynvml.py        the CUDA driver bindings, where installed (GPU machines)

The interpreter is this venv's base interpreter if root owns it and nobody else can write it
or any directory above it, else ``/usr/bin/python3``. Usage:
``python scripts/install_helper.py [--prefix DIR]`` (as root); prints the entry point.

Only ``infinijup_helper/`` is copied of this checkout: the helper imports nothing of the
``infinijup`` package (the user's side), so nothing of it is root's to run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"


def root_only(path: str) -> bool:
    """The file and every directory above it: root's, not writable by group or others."""
    real = os.path.realpath(path)
    while True:
        try:
            st = os.stat(real)
        except OSError:
            return False
        if st.st_uid != 0 or st.st_mode & 0o022:
            return False
        if real == "/":
            return True
        real = os.path.dirname(real)


def interpreter() -> str:
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if root_only(base):
        return base
    if root_only(SYSTEM_PYTHON):
        return SYSTEM_PYTHON
    raise SystemExit(f"no interpreter only root can change: {base} and {SYSTEM_PYTHON}")


def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin else None


def copy(src: Path, dst: Path) -> None:
    """Copy a file or a tree (no __pycache__), root-owned, 0755 dirs, 0644 files (0755 if
    executable)."""
    if src.is_dir():
        dst.mkdir(mode=0o755, exist_ok=True)
        for child in src.iterdir():
            if child.name != "__pycache__":
                copy(child, dst / child.name)
        return
    shutil.copyfile(src, dst, follow_symlinks=True)
    os.chmod(dst, 0o755 if os.access(src, os.X_OK) and src.suffix != ".py" else 0o644)


def install(prefix: Path) -> Path:
    python = interpreter()
    prefix.mkdir(mode=0o755, parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".install-", dir=prefix))
    os.chmod(staging, 0o755)
    lib = staging / "lib"
    lib.mkdir(mode=0o755)
    copy(REPO / "infinijup_helper", lib / "infinijup_helper")
    protobuf = package_dir("google.protobuf")
    if protobuf is None:
        raise SystemExit("protobuf is not installed in this venv (pycriu needs it): make venv")
    (lib / "google").mkdir(mode=0o755)
    copy(protobuf, lib / "google" / "protobuf")
    cuda = package_dir("cuda")
    if cuda is not None:
        copy(cuda, lib / "cuda")
    nvml = package_dir("pynvml")
    if nvml is not None:
        copy(nvml, lib / "pynvml.py")
    bin_dir = staging / "bin"
    bin_dir.mkdir(mode=0o755)
    entry = bin_dir / "infinijup-helper"
    entry.write_text(
        f"#!{python} -I\n"
        '"""The privileged helper, as installed by scripts/install_helper.py."""\n'
        "import sys\n"
        f"sys.path.insert(0, {str(prefix / 'lib')!r})\n"
        "from infinijup_helper.__main__ import main\n"
        "sys.exit(main())\n")
    os.chmod(entry, 0o755)
    for path in [staging, *staging.rglob("*")]:
        os.lchown(path, 0, 0)
    # Swap the new copy in: a running helper keeps what it loaded.
    for name in ("lib", "bin"):
        old = prefix / name
        if old.exists():
            shutil.rmtree(old)
        os.rename(staging / name, old)
    staging.rmdir()
    os.chown(prefix, 0, 0)
    os.chmod(prefix, 0o755)
    return prefix / "bin" / "infinijup-helper"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="/opt/infinijup/helper")
    ns = parser.parse_args()
    if os.geteuid() != 0:
        print("installing the helper needs root: sudo make helper", file=sys.stderr)
        return 2
    prefix = Path(ns.prefix)
    parent = prefix.parent
    parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not root_only(str(parent)):
        print(f"{parent} (or a directory above it) is not root's alone: choose another "
              "HELPER_PREFIX", file=sys.stderr)
        return 2
    print(install(prefix))
    _warn_if_unreadable()
    return 0


def _warn_if_unreadable() -> None:
    """The helper does not need the checkout, but other accounts' Jupyter servers and kernels
    do: say so when they cannot read it (a clone under a 0700 home)."""
    for path in (sys.executable, str(REPO / "infinijup" / "__init__.py")):
        real = os.path.realpath(path)
        parts = real.split("/")
        for i in range(2, len(parts) + 1):
            st = os.stat("/".join(parts[:i]) or "/")
            if not st.st_mode & 0o001 and not (i == len(parts) and st.st_mode & 0o004):
                print(f"note: other accounts cannot reach {real} ({'/'.join(parts[:i])} is "
                      f"closed to them): their Jupyter servers and kernels cannot run from this "
                      "checkout; install it where every account can read it (e.g. a clone "
                      "under /opt or /srv) for them. Root's own server is not affected.",
                      file=sys.stderr)
                return


if __name__ == "__main__":
    sys.exit(main())
