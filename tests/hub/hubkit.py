"""Tools for the JupyterHub test (issue 14): a real JupyterHub process on this machine, its
configurable-http-proxy, LocalProcessSpawner starting ``jupyterhub-singleuser`` with Infinijup as
real system accounts, and the idle culler as a hub-managed service.

The hub runs as root (LocalProcessSpawner switches to each user); each single-user server runs
as its account with the system Python and this checkout's packages on PYTHONPATH, as
tests/reliability's ``ServerProcess`` does for a second account (the venv's interpreter may sit
where other accounts cannot reach, e.g. under a 0700 /root).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS / "reliability"))
from reliakit import USER_PYTHON, as_user, checkout_closed_to, user_pythonpath  # noqa: E402

PROXY = HERE / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
ACCOUNT_PREFIX = "infinijup-hub-"  # + a letter, "-", the test process's pid
CULLED_GROUP = "hibernate-when-idle"  # the users whose idle servers the culler stops


def missing() -> str | None:
    """Why the hub test cannot run here, or None."""
    for module, package in (("jupyterhub", "jupyterhub"),
                            ("jupyterhub_idle_culler", "jupyterhub-idle-culler")):
        try:
            __import__(module)
        except ImportError:
            return f"{package} is not installed (pip install -e '.[test]')"
    if not os.access(PROXY, os.X_OK):
        return f"configurable-http-proxy is not installed ({PROXY}; make setup installs it)"
    if os.geteuid() != 0:
        return "JupyterHub's LocalProcessSpawner needs root to start servers as other accounts"
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        return "useradd/userdel are not installed: no real accounts can be created"
    if not os.access(USER_PYTHON, os.X_OK):
        return f"{USER_PYTHON} is missing: the accounts' servers run with the system Python"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- real accounts -------------------------------------------------------------------------------
def create_account(letter: str, homes: Path) -> pwd.struct_passwd:
    """A real account for this test run, its home under ``homes`` (0700, its own). Accounts of
    runs whose process is gone are removed first."""
    for entry in pwd.getpwall():
        pid = entry.pw_name.removeprefix(ACCOUNT_PREFIX).partition("-")[2]
        if entry.pw_name.startswith(ACCOUNT_PREFIX) and pid.isdigit() and \
                not psutil.pid_exists(int(pid)):
            subprocess.run(["userdel", entry.pw_name], check=False, capture_output=True)
    name = f"{ACCOUNT_PREFIX}{letter}-{os.getpid()}"
    home = homes / name
    subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell",
                    "/usr/sbin/nologin", name], check=True)
    user = pwd.getpwnam(name)
    home.mkdir(mode=0o700, parents=True)
    os.chown(home, user.pw_uid, user.pw_gid)
    return user


def processes_of(user: pwd.struct_passwd) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.uids().real == user.pw_uid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def remove_account(user: pwd.struct_passwd) -> None:
    """Remove the account once none of its processes is left (the hub stopped its server)."""
    deadline = time.monotonic() + 30
    while processes_of(user) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in processes_of(user):  # this run's own account: whatever is left is ours
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes_of(user), timeout=30)
    subprocess.run(["userdel", user.pw_name], check=False)


def store_commits(user: pwd.struct_passwd, store: Path) -> list[dict[str, Any]]:
    """The commits of ``user``'s store, read as that user (root opening it would leave files
    the user cannot write)."""
    def read() -> list[dict[str, Any]]:
        from infinijup.store import Repository

        with Repository.open(store) as repo:
            return [{"id": c.id, "message": c.message, "thread": c.thread} for c in repo.log()]

    out = as_user(user, read)
    assert "value" in out, out
    return out["value"]


# --- the hub ----------------------------------------------------------------------------------------
class Hub:
    """``jupyterhub`` as a child process, in its own directory, on free ports.

    The single-user servers load Infinijup with ``SnapshotManager.hibernate_on_shutdown`` (the
    configuration docs/jupyterhub.md describes). The idle culler is a hub service with a short
    ``--timeout``; its role lets it see only the members of ``CULLED_GROUP``, so a test decides
    *which* servers may be culled (by group membership, through the hub's API), never *when* by
    a delay."""

    def __init__(self, base: Path, helper_socket: str, users: list[str],
                 culler_timeout: int = 1) -> None:
        import secrets

        self.base = base
        self.dir = base / "hub"
        self.dir.mkdir(parents=True)
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = secrets.token_hex(32)
        self.users = users
        # the single-user servers' Jupyter config and kernelspec, readable by every account
        shared = base / "singleuser"
        config, data = shared / "config", shared / "data"
        (data / "kernels" / "infinijup").mkdir(parents=True)
        config.mkdir(parents=True)
        (data / "kernels" / "infinijup" / "kernel.json").write_text(json.dumps({
            "argv": [USER_PYTHON, "-m", "infinijup.kernel_magics.launch", "-f",
                     "{connection_file}"],
            "display_name": "Python 3 (Infinijup)", "language": "python",
            "metadata": {"kernel_provisioner": {"provisioner_name": "infinijup-provisioner"}}}))
        (config / "jupyter_server_config.json").write_text(json.dumps({
            "ServerApp": {"jpserver_extensions": {"infinijup": True}},
            # a hang guard on a loaded machine, never what decides the test
            "SnapshotManager": {"hibernate_on_shutdown": True, "busy_timeout": 60.0}}))
        for path in [shared, *shared.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        self.singleuser_env = {
            "PYTHONPATH": user_pythonpath(), "PATH": "/usr/bin:/bin",
            "JUPYTER_CONFIG_PATH": str(config), "JUPYTER_PATH": str(data),
            "JUPYTER_PLATFORM_DIRS": "1", "INFINIJUP_HELPER_SOCKET": helper_socket,
        }
        culler = [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={culler_timeout}",
                  "--cull-every=2"]
        hub_config = f"""
c = get_config()  # noqa
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {self.port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {self.hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{self.api_port}"
c.ConfigurableHTTPProxy.command = [{str(PROXY)!r}]
c.JupyterHub.db_url = "sqlite:///{self.dir / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = {str(self.dir / 'cookie_secret')!r}
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = set({users!r})
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [{USER_PYTHON!r}, "-m", "jupyterhub.singleuser"]
c.Spawner.environment = {self.singleuser_env!r}
# hang guards on a loaded machine
c.Spawner.start_timeout = 600
c.Spawner.http_timeout = 600
# a stopping server hibernates its kernels (a snapshot each) before it exits: give it time
# before SIGTERM / SIGKILL
c.LocalProcessSpawner.interrupt_timeout = 600
c.JupyterHub.load_groups = {{{CULLED_GROUP!r}: {{"users": []}}}}
c.JupyterHub.services = [
    {{"name": "idle-culler", "command": {culler!r}}},
    {{"name": "test-admin", "api_token": {self.admin_token!r}}},
]
c.JupyterHub.load_roles = [
    {{"name": "idle-culler", "services": ["idle-culler"], "scopes": [
        "list:users!group={CULLED_GROUP}", "read:users:activity!group={CULLED_GROUP}",
        "read:servers!group={CULLED_GROUP}", "delete:servers!group={CULLED_GROUP}"]}},
    {{"name": "test-admin", "services": ["test-admin"], "scopes": [
        "admin:users", "admin:servers", "admin:groups", "tokens"]}},
]
"""
        (self.dir / "jupyterhub_config.py").write_text(hub_config)
        self.log_path = self.dir / "jupyterhub.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> None:
        self._log = open(self.log_path, "ab")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JUPYTER", "JPY_", "INFINIJUP_SERVER"))}
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(self.dir / "jupyterhub_config.py")],
            cwd=str(self.dir), env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.api("GET", "/")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"jupyterhub did not start:\n{self.log()}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # the hub stops the servers it spawned (cleanup_servers)
            try:
                self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    # --- HTTP ---------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None, token: str = "",
                timeout: float = 600.0) -> tuple[int, Any]:
        """``path`` on the hub's public URL (through the proxy), with ``token``."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"token {token}"
        data = json.dumps(body).encode() if body is not None else (
            b"" if method == "POST" else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(req, timeout=timeout) as resp:
                raw = resp.read()
                return resp.status, _json(raw)
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())

    def api(self, method: str, path: str, body: dict | None = None,
            token: str | None = None) -> tuple[int, Any]:
        return self.request(method, "/hub/api" + path, body,
                            self.admin_token if token is None else token)

    def user_model(self, name: str) -> dict:
        code, model = self.api("GET", f"/users/{name}")
        assert code == 200, (code, model)
        return model

    def user_token(self, name: str) -> str:
        code, body = self.api("POST", f"/users/{name}/tokens", {"note": "hub test"})
        assert code in (200, 201), (code, body)
        return body["token"]

    def start_server(self, name: str, timeout: float = 600.0) -> dict:
        """Ask the hub for ``name``'s server and wait for the hub to say it is ready."""
        code, body = self.api("POST", f"/users/{name}/server")
        assert code in (201, 202), (code, body, self.log())
        return self.wait_server(name, ready=True, timeout=timeout)

    def wait_server(self, name: str, ready: bool, timeout: float = 600.0) -> dict:
        """Wait until the hub's API says ``name``'s server is ready (``ready``) or stopped
        (no server and nothing pending). A hang guard only: the event decides."""
        deadline = time.monotonic() + timeout
        while True:
            model = self.user_model(name)
            server = model.get("servers", {}).get("")
            if ready and server and server.get("ready"):
                return model
            if not ready and not server and not model.get("pending"):
                return model
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"jupyterhub exited:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}'s server not {'ready' if ready else 'stopped'} "
                                     f"after {timeout} s: {model}\n{self.log()}")
            time.sleep(0.2)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a 302 to a login page is an answer too
        return None


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"raw": raw.decode(errors="replace")[:500]}


# --- a notebook through the hub's proxy ----------------------------------------------------------
def notebook_via_hub(hub: Hub, user: str, token: str, path: str):
    """A kernelkit ``Notebook`` whose REST calls and kernel websocket go through the hub's
    proxy to ``user``'s server, with ``token`` (the user's API token)."""
    from urllib.parse import urlencode

    from kernelkit import Notebook
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest
    from tornado.websocket import websocket_connect

    base = f"{hub.url}/user/{user}/"
    headers = {"Authorization": f"token {token}"}

    async def fetch(*parts, method="GET", body=None, params=None, request_timeout=600,
                    raise_error=True, **_kw):
        url = base + "/".join(parts) + (f"?{urlencode(params)}" if params else "")
        return await AsyncHTTPClient().fetch(
            url, method=method, body=body, headers=headers, request_timeout=request_timeout,
            raise_error=raise_error, allow_nonstandard_methods=True, follow_redirects=False)

    async def ws_fetch(*parts, params=None):
        url = base.replace("http://", "ws://") + "/".join(parts) + (
            f"?{urlencode(params)}" if params else "")
        return await websocket_connect(HTTPRequest(url, headers=headers, request_timeout=600))

    return Notebook(fetch, ws_fetch, path)


async def first_answer(nb, msg_id: str, timeout: float = 600.0) -> dict:
    """An execute request's outputs up to its reply, and its idle status when it ran: a
    request that could not run (the kernel failed to wake) is answered with an error reply
    and no status, and that answer is what the test shows."""
    import asyncio

    out = {"stdout": "", "result": None, "error": None, "reply": None}
    idle = False
    deadline = time.monotonic() + timeout
    while out["reply"] is None or (out["reply"].get("status") == "ok" and not idle):
        left = deadline - time.monotonic()
        assert left > 0, f"no answer to {msg_id} in {timeout} s: {out}"
        raw = await asyncio.wait_for(nb.ws.read_message(), left)
        assert raw is not None, "the kernel websocket closed"
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content.get("name") == "stdout":
            out["stdout"] += content["text"]
        elif kind == "execute_result":
            out["result"] = content["data"].get("text/plain")
        elif kind == "error":
            out["error"] = f"{content['ename']}: {content['evalue']}"
        elif kind == "execute_reply":
            out["reply"] = content
        elif kind == "status" and content.get("execution_state") == "idle":
            idle = True
    return out


__all__ = ["first_answer", "Hub", "as_user", "create_account", "missing", "notebook_via_hub", "processes_of",
           "checkout_closed_to", "remove_account", "store_commits"]
