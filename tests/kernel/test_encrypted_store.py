"""A real server over an encrypted local store (issue 31): the store is made with
``store init --encrypt``'s code, the server unlocks it from INFINIJUP_STORE_PASSWORD_FILE, a
kernel holding a planted secret is snapshotted and restored from the store (hot tier off),
and no file under the store holds the secret."""

from __future__ import annotations

import pytest
from kernelkit import Notebook, needs_helper

from infinijup.store import Repository
from infinijup.store.keys import Credentials

pytestmark = [needs_helper, pytest.mark.timeout(300)]
SECRET = "sk-live-SERVER-PLANTED-9d1c"


@pytest.fixture
def jp_server_config(helper_daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", helper_daemon.socket_path)
    monkeypatch.setenv("INFINIJUP_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("INFINIJUP_RESULTS_DIR", str(tmp_path / "results"))
    password = tmp_path / "password"
    password.write_text("server password\n")
    monkeypatch.setenv("INFINIJUP_STORE_PASSWORD_FILE", str(password))
    Repository.init(tmp_path / "store",
                    encrypt=Credentials.build(password_file=password)).close()
    return {"ServerApp": {"jpserver_extensions": {"infinijup": True},
                          "allow_unauthenticated_access": False},
            # the hot tier would keep plain images in the helper's work dir (docs/store.md)
            "SnapshotManager": {"busy_timeout": 60.0, "hot_tier_bytes": 0}}


async def test_snapshot_and_restore_through_an_encrypted_store(notebook: Notebook, tmp_path):
    await notebook.execute(f"held = [{SECRET!r} * 1000 for _ in range(100)]; x = 41")
    snap = await notebook.snapshot(message="before")
    await notebook.execute("x = 0; held = None")
    await notebook.restore(snap["commit"])
    assert await notebook.value("x") == 41
    assert await notebook.value(f"held[99] == {SECRET!r} * 1000")
    store = tmp_path / "store"
    hits = [p for p in store.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert hits == [], hits
    with Repository.open(store) as repo:
        assert repo.config.encrypted and [c.id for c in repo.log()] == [snap["commit"]]
