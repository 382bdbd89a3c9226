"""Resume anywhere (issue 11): a snapshot comes back in a new kernel, in another notebook's
running kernel, and side by side with the kernel that took it. Real server, helper and CRIU."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import uuid

import pytest
import tornado.httpclient
import tornado.websocket
from jupyter_server.utils import url_path_join
from kernelkit import Notebook, needs_helper

from infinijup.store import Repository
from infinijup.store.checkout import checkout_dir

pytestmark = [needs_helper, pytest.mark.timeout(300)]

PATH = "story.ipynb"
SETUP = """
import numpy as np, random
x = 41
random.seed(3); random.random()
rng = np.random.default_rng(7); rng.random()
with open('data.txt', 'w') as _f: _f.write('abcdefghijklmnopqrstuvwxyz')
f = open('data.txt'); f.read(5)
"""
NEXT = "(x, random.random(), float(rng.random()), f.read(3))"


async def attach(nb: Notebook, kernel_id: str) -> Notebook:
    nb.kernel_id = kernel_id
    nb.ws = await nb.ws_fetch("api", "kernels", kernel_id, "channels",
                              params={"session_id": nb.session})
    return nb


async def resume(nb: Notebook, commit: str, **body) -> tuple[int, dict]:
    r = await nb.post("resume", {"path": nb.path, "commit": commit, **body})
    return r.code, json.loads(r.body)


async def value_after_resume(nb: Notebook, commit: str, expr: str) -> object:
    """``commit`` resumed into a new kernel of ``nb``'s notebook, ``expr``'s value there."""
    code, body = await resume(nb, commit)
    assert code == 200, body
    other = await attach(Notebook(nb.fetch, nb.ws_fetch, nb.path), body["kernel_id"])
    try:
        return await other.value(expr)
    finally:
        await other.close()


async def kernel_ids(nb: Notebook) -> set[str]:
    r = await nb.fetch("api", "kernels")
    return {k["id"] for k in json.loads(r.body)}


async def test_resume_after_kernel_shutdown(notebook: Notebook, jp_root_dir):
    await notebook.execute(f"import os; os.chdir({str(jp_root_dir)!r})\n{SETUP}")
    snap = await notebook.snapshot(message="before")
    expected = await notebook.value(NEXT)  # what the state at the snapshot draws next
    await notebook.fetch("api", "kernels", notebook.kernel_id, method="DELETE")
    old_id, notebook.kernel_id = notebook.kernel_id, ""

    hist = json.loads((await notebook.fetch("infinijup", "history",
                                            params={"path": PATH})).body)
    assert [(c["id"], c["resumable"]) for c in hist["commits"]] == [(snap["commit"], True)]

    code, body = await resume(notebook, snap["commit"])
    assert code == 200, body
    assert body["kernel_id"] != old_id and body["started"] and body["path"] == PATH
    nb = await attach(Notebook(notebook.fetch, notebook.ws_fetch, PATH), body["kernel_id"])
    try:
        assert await nb.value(NEXT) == expected
        # the kernel knows its new id: %snapshot from inside lands on this kernel's thread
        out = await nb.execute("%snapshot -m 'from the resumed kernel'")
        assert "Snapshot" in out["stdout"], out
        hist = await nb.history()
        mine = [c for c in hist["commits"] if c["message"] == "from the resumed kernel"]
        assert len(mine) == 1 and mine[0]["parents"] == [snap["commit"]], hist
    finally:
        await nb.close()


def _pid_namespaces(helper_daemon) -> bool:
    from infinijup.helper_client import HelperClient

    return bool(HelperClient(helper_daemon.socket_path).hello().features.get("pid_namespace"))


async def test_side_by_side_and_into_another_notebook(notebook: Notebook, jp_root_dir,
                                                      helper_daemon):
    if not _pid_namespaces(helper_daemon):
        pytest.skip("this helper runs kernels without PID namespaces (a CUDA machine): a copy "
                    "cannot be restored beside the kernel it came from, whose pids it needs")
    await notebook.execute("x = 1; import random; random.seed(5)")
    snap = await notebook.snapshot(message="template")
    (c1, r1), (c2, r2) = await asyncio.gather(
        resume(notebook, snap["commit"], new_notebook=True),
        resume(notebook, snap["commit"], new_notebook=True))
    assert (c1, c2) == (200, 200), (r1, r2)
    assert len({r1["kernel_id"], r2["kernel_id"], notebook.kernel_id}) == 3
    assert r1["path"] != r2["path"] and (jp_root_dir / r1["path"]).is_file()
    a = await attach(Notebook(notebook.fetch, notebook.ws_fetch, r1["path"]), r1["kernel_id"])
    b = await attach(Notebook(notebook.fetch, notebook.ws_fetch, r2["path"]), r2["kernel_id"])
    try:
        # the copy's history shows where its kernel came from (issue 28, item 4)
        hist = await a.history()
        assert hist["head"]["commit"] == snap["commit"], hist["head"]
        assert [(c["id"], c.get("notebook")) for c in hist["commits"]] == \
            [(snap["commit"], PATH)], hist["commits"]
        # one session per notebook (issue 28, item 5)
        sessions = json.loads((await notebook.fetch("api", "sessions")).body)
        paths = sorted(s["path"] for s in sessions)
        assert sorted({PATH, r1["path"], r2["path"]}) == paths, paths
        draws = [await nb.value("random.random()") for nb in (notebook, a, b)]
        assert draws[0] == draws[1] == draws[2]  # three live copies of one state
        await a.execute("x += 10")
        await b.execute("x += 20")
        sa, sb = await a.snapshot(message="a"), await b.snapshot(message="b")
        assert (await a.value("x"), await b.value("x"), await notebook.value("x")) == (11, 21, 1)
        assert sa["parents"] == sb["parents"] == [snap["commit"]]
        assert sa["commit"] != sb["commit"]

        # a commit of one notebook into another notebook's running kernel: same kernel id,
        # the same websocket keeps working
        await b.restore(sa["commit"])
        assert await b.value("x") == 11
        await b.execute("x += 1")
        assert await b.value("x") == 12 and await a.value("x") == 11
    finally:
        await a.close()
        await b.close()


def _recommit(store, commit_id: str, tmp_path, edit) -> str:
    """A new commit of ``commit_id``'s images with its metadata (and images) edited."""
    repo = Repository.open(store)
    try:
        src = repo.get_commit(commit_id)
        work = tmp_path / f"re-{uuid.uuid4().hex[:8]}"
        checkout_dir(repo, commit_id, work)
        meta = json.loads(json.dumps(src.metadata))
        edit(meta, work)
        c = repo.commit_dir(work, thread=f"{src.thread}-edited-{work.name}",
                            message="edited", metadata=meta, parents=[commit_id],
                            expected_tip=None)
        shutil.rmtree(work)
        return c.id
    finally:
        repo.close()


async def test_bad_resumes_start_nothing(notebook: Notebook, tmp_path, monkeypatch):
    import os

    await notebook.execute("x = 7")
    snap = await notebook.snapshot()
    store = os.environ["INFINIJUP_STORE"]
    before = await kernel_ids(notebook)

    code, body = await resume(notebook, "0123456789abcdef")
    assert code == 404, body

    def no_key(meta, work):
        meta["connection"].pop("key")

    def other_gpu(meta, work):
        gpus = [{"index": i, "name": "NVIDIA B200", "pci_bus_id": f"0000:{i:02x}:00.0",
                 "uuid": f"GPU-0000000{i}-0000-0000-0000-000000000000",
                 "memory_total": 192 << 30} for i in range(8)]
        meta["gpu"] = {"fingerprint": {"gpus": gpus, "driver_version": "999.1",
                                       "cuda_driver_version": 99000}}

    def short_pages(meta, work):
        pages = sorted(work.glob("pages-*.img"), key=lambda p: p.stat().st_size)[-1]
        with open(pages, "r+b") as f:
            f.truncate(pages.stat().st_size - 4096)

    for edit, status, reason in ((no_key, 422, "not_resumable_here"), (other_gpu, 422, "gpu_mismatch"),
                                 (short_pages, 500, None)):
        commit = _recommit(store, snap["commit"], tmp_path, edit)
        code, body = await resume(notebook, commit, new_notebook=True)
        assert code == status, body
        assert reason is None or body["reason"] == reason, body
        assert await kernel_ids(notebook) == before  # nothing started is left running
    assert await notebook.value("x") == 7


async def test_a_copy_resumed_without_a_session_gets_the_one_its_client_makes(notebook: Notebook):
    """Issue 28, item 5: Lab opens its own session for a notebook it opens on a kernel, so the
    UI's "Open in new notebook" asks for no session (session: false); the kernel knows its
    notebook meanwhile, and the session Lab then makes is the only one for the copy."""
    await notebook.execute("x = 5")
    snap = await notebook.snapshot(message="template")
    code, body = await resume(notebook, snap["commit"], new_notebook=True, session=False)
    assert code == 200 and body["session_id"] is None and body["started"], body
    copy, kernel_id = body["path"], body["kernel_id"]
    sessions = json.loads((await notebook.fetch("api", "sessions")).body)
    assert copy not in {s["path"] for s in sessions}
    r = await notebook.fetch("infinijup", "history", params={"kernel_id": kernel_id})
    assert json.loads(r.body)["path"] == copy
    # what Lab does: a session under a temporary path on that kernel, then renamed
    r = await notebook.fetch("api", "sessions", method="POST", body=json.dumps(
        {"path": uuid.uuid4().hex, "type": "notebook", "name": "",
         "kernel": {"id": kernel_id}}))
    made = json.loads(r.body)
    await notebook.fetch("api", "sessions", made["id"], method="PATCH",
                         body=json.dumps({"path": copy}))
    sessions = json.loads((await notebook.fetch("api", "sessions")).body)
    assert [s["kernel"]["id"] for s in sessions if s["path"] == copy] == [kernel_id]
    nb = await attach(Notebook(notebook.fetch, notebook.ws_fetch, copy), kernel_id)
    try:
        assert await nb.value("x") == 5
    finally:
        await nb.close()


async def _resumed_and_answering(notebook: Notebook, resumed, kernel_id: str, ws,  # noqa: ANN001
                                 caplog) -> None:  # noqa: ANN001
    """The resume answered for ``kernel_id``, and ``ws`` carries a cell there at once, with no
    60 s wait for a kernel_info reply behind it."""
    code, body = await resumed
    assert code == 200 and body["kernel_id"] == kernel_id, body
    nb = Notebook(notebook.fetch, notebook.ws_fetch, notebook.path)
    nb.kernel_id, nb.ws = kernel_id, ws
    try:
        assert await nb.value("x + 1") == 42
    finally:
        ws.close()
    assert "Timeout waiting for kernel_info reply" not in caplog.text


def _open_channels(port: int, base_url: str, auth_header: dict, kernel_id: str):  # noqa: ANN202
    """A websocket to ``kernel_id``'s channels, as Lab opens one (the connect, awaitable)."""
    url = (f"ws://localhost:{port}{url_path_join(base_url, 'api/kernels', kernel_id)}"
           f"/channels?session_id={uuid.uuid4().hex}")
    return tornado.websocket.websocket_connect(tornado.httpclient.HTTPRequest(
        url, headers=dict(auth_header), connect_timeout=600, request_timeout=600))


async def test_a_websocket_opened_while_the_resume_restores_waits_for_it(
        notebook: Notebook, jp_serverapp, jp_http_port, jp_base_url, jp_auth_header, caplog):
    """As Lab does after a resume into the notebook whose kernel was shut down: the session
    shows the new kernel, and the notebook connects while the restore replaces its process.
    The websocket opens once the restore is done (jupyter_server's own wait for the kernel's
    kernel_info would have lasted its 60 s timeout: the restored kernel signs with its
    snapshot's key until it is adopted), and carries cells at once."""
    await notebook.execute("x = 41")
    snap = await notebook.snapshot(message="before")
    await notebook.fetch("api", "kernels", notebook.kernel_id, method="DELETE")
    old = notebook.kernel_id
    lifecycle = jp_serverapp.web_app.settings["infinijup_manager"].lifecycle
    resumed = asyncio.ensure_future(resume(notebook, snap["commit"]))
    kernel_id = None
    while kernel_id is None:
        for s in await jp_serverapp.session_manager.list_sessions():
            if s.get("path") == notebook.path and s["kernel"]["id"] != old:
                kernel_id = s["kernel"]["id"]
        await asyncio.sleep(0.01)
    while lifecycle.state(kernel_id) != "restoring":
        await asyncio.sleep(0.005)
    ws = await _open_channels(jp_http_port, jp_base_url, jp_auth_header, kernel_id)
    await _resumed_and_answering(notebook, resumed, kernel_id, ws, caplog)


async def test_a_websocket_opened_before_the_resume_restores_waits_for_it(
        notebook: Notebook, jp_serverapp, jp_http_port, jp_base_url, jp_auth_header, caplog,
        tmp_path, monkeypatch):
    """The same, with the websocket opened before the restore has begun: the resume's kernel
    is started and its session listed, and the server is held in the restore's plan (a hold
    point, serverext/restore_flow.py). The websocket waits for the restore from there, not
    only once the kernel is marked restoring: had it asked the kernel that the restore then
    replaces for its kernel_info, the answer could be lost with that process (its 60 s wait)."""
    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv("INFINIJUP_STORE_HOLDS", str(holds))
    caplog.set_level(logging.INFO)
    await notebook.execute("x = 41")
    snap = await notebook.snapshot(message="before")
    await notebook.fetch("api", "kernels", notebook.kernel_id, method="DELETE")
    old = notebook.kernel_id
    manager = jp_serverapp.web_app.settings["infinijup_manager"]
    (holds / "restore_plan").touch()
    resumed = asyncio.ensure_future(resume(notebook, snap["commit"]))
    while not (holds / "restore_plan.reached").exists():
        assert not resumed.done(), resumed.result()
        await asyncio.sleep(0.01)
    kernel_id = next(s["kernel"]["id"] for s in await jp_serverapp.session_manager.list_sessions()
                     if s.get("path") == notebook.path and s["kernel"]["id"] != old)
    assert manager.lifecycle.state(kernel_id) != "restoring"  # the restore has not begun
    opening = asyncio.ensure_future(
        _open_channels(jp_http_port, jp_base_url, jp_auth_header, kernel_id))
    waits = f"a websocket of kernel {kernel_id} waits for its restore"
    while waits not in caplog.text and not opening.done():
        await asyncio.sleep(0.01)
    assert not opening.done(), "the websocket opened on the kernel the restore replaces"
    (holds / "restore_plan").unlink()
    await _resumed_and_answering(notebook, resumed, kernel_id, await opening, caplog)
