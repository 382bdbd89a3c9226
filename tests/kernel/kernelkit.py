"""Tools for the kernel tests: a real Jupyter server with Infinijup, a real helper daemon, real
kernels under CRIU. A unique module name (not ``conftest``), so test modules of any directory
import it without clashing with other directories' conftest modules."""

from __future__ import annotations

import functools
import json
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helper"))
from helperkit import MISSING, HelperDaemon, make_base  # noqa: E402

needs_helper = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="session")
def helper_daemon():
    if MISSING:
        pytest.skip(MISSING)
    daemon = HelperDaemon(make_base())
    daemon.start()
    yield daemon
    daemon.stop()
    daemon.remove()  # its files, and the GPU arena it mounted where CUDA is usable


@pytest.fixture
def jp_server_config(helper_daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", helper_daemon.socket_path)
    monkeypatch.setenv("INFINIJUP_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("INFINIJUP_RESULTS_DIR", str(tmp_path / "results"))
    return {
        "ServerApp": {"jpserver_extensions": {"infinijup": True},
                      "allow_unauthenticated_access": False},
        # a hang guard on a loaded machine (a test wanting a 409 sets its own)
        "SnapshotManager": {"busy_timeout": 60.0},
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


class Notebook:
    """A notebook's view of the server: a session, its kernel's websocket, REST calls."""

    def __init__(self, fetch, ws_fetch, path: str) -> None:
        # jp_fetch gives up after 20 s; a snapshot on a loaded machine may take longer: only
        # a hang guard here (a call may still pass its own request_timeout)
        self.fetch = functools.partial(fetch, request_timeout=600)
        self.ws_fetch, self.path = ws_fetch, path
        self.session = uuid.uuid4().hex
        self.kernel_id = ""
        self.ws = None

    async def start(self, kernel_name: str) -> Notebook:
        r = await self.fetch("api", "sessions", method="POST", body=json.dumps(
            {"path": self.path, "type": "notebook", "name": self.path,
             "kernel": {"name": kernel_name}}))
        self.kernel_id = json.loads(r.body)["kernel"]["id"]
        self.ws = await self.ws_fetch("api", "kernels", self.kernel_id, "channels",
                                      params={"session_id": self.session})
        await self.execute("1", timeout=60)  # the kernel answers
        return self

    def _msg(self, msg_type: str, content: dict, channel: str = "shell") -> dict:
        return {"header": {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "test",
                           "session": self.session, "date": "", "version": "5.3"},
                "parent_header": {}, "metadata": {}, "content": content, "channel": channel,
                "buffers": []}

    def send_execute(self, code: str) -> str:
        msg = self._msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                            "user_expressions": {}, "allow_stdin": False,
                                            "stop_on_error": True})
        self.ws.write_message(json.dumps(msg))
        return msg["header"]["msg_id"]

    async def collect(self, msg_id: str, timeout: float = 120) -> dict:
        """Outputs of one execute request: stdout text, result, reply, once idle again."""
        out = {"stdout": "", "stderr": "", "result": None, "reply": None, "error": None}
        idle = False
        deadline = time.monotonic() + timeout
        import asyncio

        while not (idle and out["reply"] is not None):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no complete answer to {msg_id} in {timeout} s: {out}")
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            assert raw is not None, "the kernel websocket closed"
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "execute_result":
                out["result"] = content["data"].get("text/plain")
            elif kind == "error":
                out["error"] = f"{content['ename']}: {content['evalue']}"
            elif kind.endswith("_reply"):
                out["reply"] = content
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        return out

    async def execute(self, code: str, timeout: float = 120) -> dict:
        out = await self.collect(self.send_execute(code), timeout)
        assert out["error"] is None, out["error"]
        return out

    async def reconnect(self) -> None:
        """What a browser tab reload does: a new websocket (new client session), kernel_info."""
        self.ws.close()
        self.session = uuid.uuid4().hex
        self.ws = await self.ws_fetch("api", "kernels", self.kernel_id, "channels",
                                      params={"session_id": self.session})
        msg = self._msg("kernel_info_request", {})
        self.ws.write_message(json.dumps(msg))
        await self.collect(msg["header"]["msg_id"])

    async def restart(self) -> None:
        """What Lab's restart does: the REST call, then a new websocket (Lab reconnects, so its
        channels are subscribed again before anything is sent; requests sent on the old
        websocket while the new process binds its ports can lose their IOPub messages)."""
        r = await self.fetch("api", "kernels", self.kernel_id, "restart", method="POST",
                             body="{}")
        assert r.code == 200, r.body
        await self.reconnect()

    async def value(self, expr: str):
        out = await self.execute(f"print(repr({expr}))")
        return eval(out["stdout"].strip())  # noqa: S307 - our own test values

    async def post(self, route: str, body: dict):
        return await self.fetch("infinijup", route, method="POST", body=json.dumps(body),
                                raise_error=False)

    async def snapshot(self, **body) -> dict:
        r = await self.post("snapshot", {"kernel_id": self.kernel_id, **body})
        assert r.code == 201, r.body
        return json.loads(r.body)

    async def restore(self, commit: str, **body) -> dict:
        r = await self.post("restore", {"kernel_id": self.kernel_id, "commit": commit, **body})
        assert r.code == 200, r.body
        return json.loads(r.body)

    async def history(self) -> dict:
        r = await self.fetch("infinijup", "history", params={"kernel_id": self.kernel_id})
        return json.loads(r.body)

    async def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        if self.kernel_id:
            await self.fetch("api", "kernels", self.kernel_id, method="DELETE", raise_error=False)


OPERATION_EVENTS = "https://events.infinijup.dev/operation"


@pytest.fixture
def operation_events(jp_serverapp) -> list[dict]:
    """Every operation event the server emits from now on (its listeners run as tasks: let
    them drain before looking)."""
    seen: list[dict] = []

    async def listener(logger, schema_id, data):  # noqa: ANN001
        seen.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=OPERATION_EVENTS, listener=listener)
    return seen


@pytest.fixture
def notebook(jp_fetch, jp_ws_fetch, jp_serverapp, infinijup_kernelspec, jp_asyncio_loop):
    # pytest-jupyter runs async tests on its own loop: drive the fixture's coroutines there.
    nb = Notebook(jp_fetch, jp_ws_fetch, "story.ipynb")
    jp_asyncio_loop.run_until_complete(nb.start(infinijup_kernelspec))
    yield nb
    jp_asyncio_loop.run_until_complete(nb.close())
