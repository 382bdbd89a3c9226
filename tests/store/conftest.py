"""Fixtures for the store tests.

The tests import the package from the working tree (and so do the subprocesses they start).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from infinijup.store import Repository  # noqa: E402
from infinijup.store.chunking import ChunkerParams, fastcdc_params, fixed_params  # noqa: E402


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that must import the package from this checkout."""
    env = dict(os.environ)
    paths = [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def random_bytes(n: int, seed: int = 0) -> bytes:
    """Deterministic incompressible bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def page_image(n_pages: int, seed: int = 0) -> bytearray:
    """A synthetic page image: half random pages, half compressible structured pages."""
    rng = np.random.default_rng(seed)
    pages = rng.integers(0, 256, (n_pages, 4096), dtype=np.uint8)
    structured = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    pages[::2] = structured
    pages[::2, :8] = rng.integers(0, 256, (len(pages[::2]), 8), dtype=np.uint8)
    return bytearray(pages.tobytes())


CHUNKERS: dict[str, ChunkerParams] = {
    "pagecdc": ChunkerParams(),
    "fastcdc": fastcdc_params(32 * 1024),
    "fixed": fixed_params(32 * 1024),
}


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[Repository]:
    """A fresh store with the default parameters and small packs (many packs per test)."""
    r = Repository.init(tmp_path / "store", pack_size=1 << 20)
    yield r
    r.close()


@pytest.fixture(params=sorted(CHUNKERS))
def any_repo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Repository]:
    """The same store contract with each chunker (a conformance suite over chunkers)."""
    r = Repository.init(tmp_path / "store", chunker=CHUNKERS[request.param], pack_size=1 << 20)
    yield r
    r.close()
