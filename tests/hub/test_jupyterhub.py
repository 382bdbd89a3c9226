"""Issue 14's JupyterHub story, with a real hub on this machine: the hub's idle culler stops a
user's server; the single-user server (Infinijup, ``hibernate_on_shutdown``) hibernates its
kernel first; the user comes back, opens the same notebook, and the next cell runs in the
hibernated state. A second user's server runs on untouched and cannot reach the first's.

Real parts: ``jupyterhub`` (DummyAuthenticator, LocalProcessSpawner), configurable-http-proxy,
``jupyterhub-singleuser`` servers running as two real accounts made for this run, the
``jupyterhub-idle-culler`` service, the helper daemon and CRIU. Every wait is for an event the
hub's API or the kernel reports; deadlines are hang guards only.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel"))
import hubkit  # noqa: E402
from kernelkit import helper_daemon, needs_helper  # noqa: E402, F401 - fixture, found by name

pytestmark = [needs_helper, pytest.mark.timeout(1800),
              pytest.mark.skipif(hubkit.missing() is not None, reason=hubkit.missing() or "")]

NB = "analysis.ipynb"
SETUP = "import random, numpy as np\nx = 41\nrandom.seed(9)\nrng = np.random.default_rng(11)"
DRAW = "(random.random(), float(rng.random()))"


def _expected_draws() -> tuple[tuple[float, float], tuple[float, float]]:
    import numpy as np

    r, g = random.Random(9), np.random.default_rng(11)
    first = (r.random(), float(g.random()))
    return first, (r.random(), float(g.random()))


def test_culled_server_hibernates_its_kernel_and_the_user_resumes_it(helper_daemon):  # noqa: F811
    from helperkit import make_base

    base = make_base()
    homes = base / "home"
    homes.mkdir(mode=0o755)
    accounts = []
    hub = None
    try:
        accounts.append(hubkit.create_account("a", homes))
        accounts.append(hubkit.create_account("b", homes))
        closed = hubkit.checkout_closed_to(accounts[0])
        if closed:
            pytest.skip(closed)
        hub = hubkit.Hub(base, helper_daemon.socket_path, [u.pw_name for u in accounts])
        hub.start()
        asyncio.run(_story(hub, *accounts))
    except BaseException:
        if hub is not None:  # the hub's log holds the single-user servers' logs too
            print(hub.log_path.read_text(errors="replace")[-60000:])
        raise
    finally:
        if hub is not None:
            hub.stop()
        for user in accounts:
            hubkit.remove_account(user)
        shutil.rmtree(base, ignore_errors=True)


async def _story(hub: hubkit.Hub, a, b) -> None:
    run = asyncio.to_thread  # the hub's API is called with blocking urllib, off the loop
    first, second = _expected_draws()
    token_a = await run(hub.user_token, a.pw_name)
    token_b = await run(hub.user_token, b.pw_name)
    await run(hub.start_server, a.pw_name)
    await run(hub.start_server, b.pw_name)

    # A works in a notebook: cells through the hub's proxy and the kernel's websocket
    nb_a = hubkit.notebook_via_hub(hub, a.pw_name, token_a, NB)
    await nb_a.start("infinijup")
    await nb_a.execute(SETUP)
    assert await nb_a.value("__import__('os').getuid()") == a.pw_uid  # the kernel runs as A
    assert await nb_a.value(DRAW) == first
    # B works too, in its own server
    nb_b = hubkit.notebook_via_hub(hub, b.pw_name, token_b, "b.ipynb")
    await nb_b.start("infinijup")
    await nb_b.execute("import os\ny = 'from b'\nb_pid = os.getpid()")
    b_pid = await nb_b.value("b_pid")
    b_started = (await run(hub.user_model, b.pw_name))["servers"][""]["started"]
    await _b_is_kept_out(hub, a.pw_name, token_b, nb_a.kernel_id)

    # A leaves; the policy makes A's idle servers cullable (the culler's role sees only that
    # group's members), and the culler stops A's server: wait for the hub to say so
    nb_a.ws.close()
    code, body = await run(hub.api, "POST", f"/groups/{hubkit.CULLED_GROUP}/users",
                           {"users": [a.pw_name]})
    assert code == 200, body
    await run(hub.wait_server, a.pw_name, False)
    code, body = await run(hub.api, "DELETE", f"/groups/{hubkit.CULLED_GROUP}/users",
                           {"users": [a.pw_name]})
    assert code == 200, body
    # it was the culler (B's refused tries at the same route are 403/404 lines of their own)
    culled = [line for line in hub.log().splitlines() if "(idle-culler@" in line and
              f"DELETE /hub/api/users/{a.pw_name}/server " in line]
    assert len(culled) == 1 and " 20" in culled[0], culled

    # A's kernel was hibernated, not lost: a record names its snapshot, the snapshot is in A's
    # store, and nothing of A runs any more (no server, no kernel process)
    assert not hubkit.processes_of(a), hubkit.processes_of(a)
    share = Path(a.pw_dir) / ".local" / "share" / "infinijup"
    records = sorted((share / "store-hibernated").glob("*.json"))
    assert len(records) == 1, records
    record = json.loads(records[0].read_text())
    assert record["kernel_id"] == nb_a.kernel_id and record["path"] == NB, record
    commits = {c["id"]: c for c in hubkit.store_commits(a, share / "store")}
    assert commits[record["commit"]]["message"] == "hibernated (server stopping)", commits

    # B's server ran on untouched: same server, same kernel process, same state
    model_b = await run(hub.user_model, b.pw_name)
    assert model_b["servers"][""]["ready"] and model_b["servers"][""]["started"] == b_started
    assert await nb_b.value("(y, os.getpid())") == ("from b", b_pid)

    # A comes back: a new server, the same notebook; its first cell wakes the kernel from the
    # hibernated snapshot and runs in that state
    await run(hub.start_server, a.pw_name)
    nb_a2 = hubkit.notebook_via_hub(hub, a.pw_name, token_a, NB)
    r = await nb_a2.fetch("api", "sessions", method="POST", body=json.dumps(
        {"path": NB, "type": "notebook", "name": NB, "kernel": {"name": "infinijup"}}))
    nb_a2.kernel_id = json.loads(r.body)["kernel"]["id"]
    assert nb_a2.kernel_id != nb_a.kernel_id  # a new server's new kernel
    nb_a2.ws = await nb_a2.ws_fetch("api", "kernels", nb_a2.kernel_id, "channels",
                                    params={"session_id": nb_a2.session})
    out = await hubkit.first_answer(nb_a2, nb_a2.send_execute("x + 1"))
    assert out["reply"]["status"] == "ok" and out["result"] == "42", out
    assert await nb_a2.value(DRAW) == second  # both generators go on where they were
    assert not list((share / "store-hibernated").glob("*.json"))  # awake: the record is spent
    history = json.loads((await nb_a2.fetch("infinijup", "history",
                                            params={"kernel_id": nb_a2.kernel_id})).body)
    assert record["commit"] in {c["id"] for c in history["commits"]}, history

    # B still untouched, and still kept out of A's (new) server
    assert await nb_b.value("(y, os.getpid())") == ("from b", b_pid)
    await _b_is_kept_out(hub, a.pw_name, token_b, nb_a2.kernel_id)
    nb_a2.ws.close()
    nb_b.ws.close()


async def _b_is_kept_out(hub: hubkit.Hub, a_name: str, token_b: str, kernel_a: str) -> None:
    """B's real token opens nothing of A's: not A's server's API, not A's kernel websocket,
    not the hub's view of A."""
    from tornado.httpclient import HTTPClientError, HTTPRequest
    from tornado.websocket import websocket_connect

    def rest() -> dict:
        seen = {}
        for method, path, body in (
            ("GET", f"/user/{a_name}/api/kernels", None),
            ("GET", f"/user/{a_name}/api/sessions", None),
            ("POST", f"/user/{a_name}/api/kernels/{kernel_a}/interrupt", None),
            ("GET", f"/user/{a_name}/infinijup/history?kernel_id={kernel_a}", None),
            ("POST", f"/user/{a_name}/infinijup/snapshot", {"kernel_id": kernel_a}),
        ):
            seen[(method, path)] = hub.request(method, path, body, token=token_b)[0]
        for method, path in (("GET", f"/users/{a_name}"), ("POST", f"/users/{a_name}/server"),
                             ("DELETE", f"/users/{a_name}/server"),
                             ("POST", f"/users/{a_name}/tokens")):
            seen[(method, "/hub/api" + path)] = hub.api(method, path, token=token_b)[0]
        return seen

    seen = await asyncio.to_thread(rest)
    assert {k: v for k, v in seen.items() if v not in (403, 404)} == {}, seen
    url = f"ws://127.0.0.1:{hub.port}/user/{a_name}/api/kernels/{kernel_a}/channels"
    with pytest.raises(HTTPClientError) as refused:
        ws = await websocket_connect(HTTPRequest(url, headers={
            "Authorization": f"token {token_b}"}, request_timeout=120))
        ws.close()
    assert refused.value.code in (403, 404), refused.value
