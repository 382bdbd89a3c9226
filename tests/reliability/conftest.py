"""Fixtures of the reliability tests: a real Jupyter server (unauthenticated access forbidden),
a real helper daemon that tests may kill, real kernels, and a store other users can reach."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from jupyter_server.auth import Authorizer
from reliakit import (
    BUSY_TIMEOUT,
    MISSING,
    KillableHelper,
    Notebook,
    make_base,
    remove_helper_base,
)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "soak: the long load test (cycles from INFINIJUP_SOAK_CYCLES, default 20)")


class DenyByHeaderAuthorizer(Authorizer):
    """Authorizes everything, except Infinijup's routes on a request carrying
    ``X-Test-Deny``: proves the routes ask jupyter_server's authorizer."""

    def is_authorized(self, handler, user, action, resource) -> bool:
        if resource == "infinijup" and handler.request.headers.get("X-Test-Deny"):
            return False
        return True


@pytest.fixture(scope="session")
def rhelper():
    if MISSING:
        pytest.skip(MISSING)
    helper = KillableHelper(make_base())
    helper.start()
    yield helper
    helper.stop()
    remove_helper_base(helper.base)


@pytest.fixture
def helper_up(rhelper) -> KillableHelper:
    rhelper.ensure_running()
    yield rhelper
    rhelper.holds.release_all()  # a failed test must not leave the helper held


@pytest.fixture
def store_base():
    """A directory everyone may traverse (0755): only the store's own modes protect it."""
    base = make_base()
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def store_path(store_base) -> str:
    return str(store_base / "store")


@pytest.fixture
def jp_server_config(helper_up, store_path, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", helper_up.socket_path)
    monkeypatch.setenv("INFINIJUP_STORE", store_path)
    monkeypatch.setenv("INFINIJUP_RESULTS_DIR", str(tmp_path / "results"))
    return {
        "ServerApp": {"jpserver_extensions": {"infinijup": True},
                      "allow_unauthenticated_access": False,
                      "authorizer_class": DenyByHeaderAuthorizer},
        "SnapshotManager": {"busy_timeout": BUSY_TIMEOUT, "store_path": store_path},
    }


@pytest.fixture
def infinijup_kernelspec(jp_data_dir):
    spec = jp_data_dir / "kernels" / "infinijup"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "infinijup.kernel_magics.launch", "-f", "{connection_file}"],
        "display_name": "Python 3 (Infinijup)",
        "language": "python",
        "metadata": {"kernel_provisioner": {"provisioner_name": "infinijup-provisioner"}},
    }))
    return "infinijup"


@pytest.fixture
def open_notebook(jp_fetch, jp_ws_fetch, jp_serverapp, infinijup_kernelspec, jp_asyncio_loop,
                  rhelper):
    """Opens notebooks (a session each, with a real kernel); closes them all afterwards."""
    opened: list[Notebook] = []

    async def open_one(path: str = "reliability.ipynb") -> Notebook:
        nb = Notebook(jp_fetch, jp_ws_fetch, path)
        opened.append(nb)
        return await nb.start(infinijup_kernelspec)

    yield open_one
    rhelper.holds.release_all()
    rhelper.ensure_running()  # a test may have left it dead: shutting kernels down needs it
    for nb in opened:
        jp_asyncio_loop.run_until_complete(nb.close())


@pytest.fixture
def notebook(open_notebook, jp_asyncio_loop) -> Notebook:
    return jp_asyncio_loop.run_until_complete(open_notebook())



@pytest.fixture(scope="session")
def other_user():
    """A second real user, this run's own (created for the tests, removed afterwards)."""
    from reliakit import ensure_other_user, remove_other_user

    if MISSING:
        pytest.skip(MISSING)
    user, created = ensure_other_user()
    yield user
    if created:
        remove_other_user(user)
