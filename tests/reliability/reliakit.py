"""Tools for the reliability tests: a helper daemon that tests may kill and restart, a store in
a directory other users can reach (so only the store's own modes keep them out), a second real
user, and ways to catch an operation in a given phase.

A unique module name (not ``conftest``) so the tests import it without clashing with the other
test directories' conftest modules. Reuses tests/helper/helperkit.py and the ``Notebook`` of
tests/kernel/kernelkit.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS / "helper"))
from helperkit import (  # noqa: E402
    CRIU,
    MISSING,
    PYCRIU,
    HelperDaemon,
    checkout_closed_to,
    make_base,
    remove_helper_base,
    socket_answers,
    unused_uid,
    user_pythonpath,
)

sys.path.insert(0, str(TESTS / "kernel"))
try:
    from kernelkit import Notebook  # noqa: E402
except ImportError:  # the kernel tests' tools still live in their conftest
    _spec = importlib.util.spec_from_file_location("infinijup_kernel_tests",
                                                   TESTS / "kernel" / "conftest.py")
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    Notebook = _module.Notebook

needs_helper = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

# How long a snapshot waits for a busy kernel (its quiesce and resume calls too). Generous: a
# hang guard on a loaded machine, never what decides a test (no test here wants a 409).
BUSY_TIMEOUT = 60.0

__all__ = ["CRIU", "PYCRIU", "Notebook", "checkout_closed_to", "needs_helper", "make_base",
           "remove_helper_base"]


# --- the helper ----------------------------------------------------------------------------------
class KillableHelper:
    """A real helper daemon on a fixed socket and work dir that a test may SIGKILL; the next
    start serves the same socket and work dir (as ``sudo make helper`` after a crash would)."""

    def __init__(self, base: Path, work_dir: str | None = None) -> None:
        self.base = base
        self.daemon: HelperDaemon | None = None
        self.socket_path = str(base / "run" / "helper.sock")
        self.work_dir = work_dir or str(base / "work")
        self.starts = 0
        self.holds = Holds(base / "holds")

    def start(self) -> None:
        self.daemon = HelperDaemon(self.base)
        self.daemon.work_dir = self.work_dir
        self.holds.release_all()
        # The helper's hold points (infinijup_helper/holds.py) read this at each point; only
        # the helper is started with it.
        os.environ[HOLDS_ENV] = str(self.holds.directory)
        try:
            self.daemon.start()
        finally:
            os.environ.pop(HOLDS_ENV, None)
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.daemon is not None and self.daemon.proc is not None
        return self.daemon.proc.pid

    def running(self) -> bool:
        return (self.daemon is not None and self.daemon.proc is not None
                and self.daemon.proc.poll() is None and socket_answers(self.socket_path))

    def ensure_running(self) -> None:
        if not self.running():
            if self.daemon is not None:
                self.daemon.stop(signal.SIGKILL)
            self.start()

    def kill(self) -> list[psutil.Process]:
        """SIGKILL the helper process only; its CRIU children and kernels are not touched.
        Returns the CRIU processes it was running (now orphans finishing their request)."""
        assert self.daemon is not None and self.daemon.proc is not None
        criu = self.criu_children()
        self.daemon.proc.send_signal(signal.SIGKILL)
        self.daemon.proc.wait()
        self.daemon.stop()
        return criu

    def restart(self) -> None:
        self.ensure_running()

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def log(self) -> str:
        return self.daemon.log() if self.daemon else ""

    def criu_children(self) -> list[psutil.Process]:
        """The ``criu swrk`` processes this helper runs right now."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        out = []
        for child in children:
            try:
                if child.cmdline()[1:2] == ["swrk"]:
                    out.append(child)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, IndexError):
                continue
        return out

    def staging_entries(self) -> list[str]:
        return os.listdir(os.path.join(self.work_dir, ".staging"))

    def user_entries(self, uid: int = 0) -> dict[str, list[str]]:
        """What is left in the caller's work dir: images/ and restore/ dirs of the engine."""
        base = os.path.join(self.work_dir, str(uid))
        out = {}
        for kind in ("images", "restore"):
            path = os.path.join(base, kind)
            out[kind] = sorted(os.listdir(path)) if os.path.isdir(path) else []
        return out


def wait_gone(procs: list[psutil.Process], timeout: float = 60.0) -> None:
    """Wait for processes (say, the CRIU a killed helper left behind) to exit."""
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"still running after {timeout} s: {alive}"


# --- waiting ---------------------------------------------------------------------------------------
async def until(predicate: Callable[[], Any], timeout: float, what: str,
                interval: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


EVENT_SCHEMA = "https://events.infinijup.dev/operation"


class OperationEvents:
    """Every operation event the server publishes (its event bus), in order: no phase is
    missed however short it is. ``close()`` stops listening."""

    def __init__(self, serverapp) -> None:
        self.logger = serverapp.event_logger
        self.events: list[dict] = []
        self.logger.add_listener(schema_id=EVENT_SCHEMA, listener=self._listen)

    async def _listen(self, logger, schema_id, data) -> None:
        self.events.append(dict(data))

    def close(self) -> None:
        self.logger.remove_listener(schema_id=EVENT_SCHEMA, listener=self._listen)

    def phases(self, kernel_id: str | None = None, op: str | None = None) -> list[str]:
        return [e["phase"] for e in self.events
                if kernel_id in (None, e["kernel_id"]) and op in (None, e["op"])]

    async def wait(self, kernel_id: str, phases: set[str], timeout: float = 120.0) -> str:
        """Wait until the kernel's operation has reached (published) one of ``phases``."""
        return await until(lambda: next((p for p in self.phases(kernel_id) if p in phases),
                                        None), timeout,
                           f"phase in {sorted(phases)} (seen {self.phases(kernel_id)})",
                           interval=0.002)



def most_at_once(events: list[dict], op: str) -> int:
    """The most operations ``op`` under way at the same moment in ``events`` (each from its
    first event to its last, "done" or "error")."""
    running: set[str] = set()
    most = 0
    for e in events:
        if e["op"] != op:
            continue
        if e["phase"] in ("done", "error"):
            running.discard(e["op_id"])
        else:
            running.add(e["op_id"])
        most = max(most, len(running))
    return most


class PhaseWatch(OperationEvents):
    """One kernel's operation phases (kept for the tests written against it)."""

    def __init__(self, serverapp, kernel_id: str) -> None:
        super().__init__(serverapp)
        self.kernel_id = kernel_id

    async def wait(self, phases: set[str], timeout: float = 120.0) -> str:  # type: ignore[override]
        return await super().wait(self.kernel_id, phases, timeout)


# --- the helper's hold points -----------------------------------------------------------------------
HOLDS_ENV = "INFINIJUP_HELPER_HOLDS"


class Holds:
    """Arms the hold points of a helper started with ``INFINIJUP_HELPER_HOLDS`` (see
    infinijup_helper/holds.py): ``arm(name)``, then ``await reached(name)`` (its details: CRIU's
    pid...), then ``release(name)``. Nothing is armed unless a test arms it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def arm(self, *names: str) -> None:
        for name in names:
            (self.directory / f"{name}.reached").unlink(missing_ok=True)
            (self.directory / name).touch()

    async def reached(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        path = self.directory / f"{name}.reached"
        await until(path.exists, timeout, f"the helper to reach {name}", interval=0.002)
        return json.loads(path.read_text())

    def is_reached(self, name: str) -> bool:
        return (self.directory / f"{name}.reached").exists()

    def release(self, *names: str) -> None:
        for name in names:
            (self.directory / name).unlink(missing_ok=True)

    def release_all(self) -> None:
        for entry in self.directory.iterdir():
            entry.unlink()


def traced_by(pid: int) -> int:
    """The pid ptrace-attached to ``pid`` (CRIU while it holds a tree frozen), or 0."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


# --- the store ------------------------------------------------------------------------------------
def store_check(path: str | Path, read_data: bool = True):
    from infinijup.store import Repository
    from infinijup.store.check import check

    with Repository.open(Path(path)) as repo:
        return check(repo, read_data=read_data)


def store_cli(path: str | Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``infinijup store --store PATH ARGS`` (the command a person would run)."""
    exe = Path(sys.executable).parent / "infinijup"  # the installed entry point
    return subprocess.run([str(exe), "store", "--store", str(path), *args],
                          capture_output=True, text=True, timeout=300)


def store_state(path: str | Path) -> dict[str, Any]:
    """Threads and commit ids: what a person sees of the store's history."""
    from infinijup.store import Repository

    with Repository.open(Path(path)) as repo:
        return {"threads": repo.threads(), "commits": sorted(c.id for c in repo.log())}


def assert_store_ok(path: str | Path) -> None:
    """``infinijup store check --read-data`` passes (exit 0); warnings (garbage) allowed."""
    done = store_cli(path, "check", "--read-data")
    assert done.returncode == 0, done.stdout + done.stderr


def tree_bytes(path: str | Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def modes_under(path: str | Path) -> dict[str, tuple[str, int]]:
    """Every entry below ``path``: kind and permission bits."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
            out[os.path.relpath(full, path)] = (kind, stat.S_IMODE(st.st_mode))
    return out


# --- a kernel through the server -------------------------------------------------------------------
def provisioner(serverapp, kernel_id: str):
    return serverapp.kernel_manager.get_kernel(kernel_id).provisioner


def kernel_pids(root_pid: int) -> list[int]:
    """The kernel tree: its init and everything below."""
    try:
        root = psutil.Process(root_pid)
        return [root_pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def ipykernel_pid(root_pid: int) -> int:
    for pid in kernel_pids(root_pid)[1:]:
        try:
            if "ipykernel" in " ".join(psutil.Process(pid).cmdline()) or \
                    "kernel_magics.launch" in " ".join(psutil.Process(pid).cmdline()):
                return pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no kernel process below {root_pid}")


BIG = """
import numpy as _np
big = _np.random.default_rng({seed}).bytes({mib} << 20)
import hashlib as _h
big_digest = _h.sha256(big).hexdigest()
"""


async def fill(nb: Notebook, mib: int, seed: int) -> str:
    """Give the kernel ``mib`` MiB of incompressible data; return its digest."""
    await nb.execute(BIG.format(mib=mib, seed=seed), timeout=120)
    return await nb.value("big_digest")


async def state_intact(nb: Notebook, digest: str, expect: dict[str, Any]) -> None:
    """The kernel answers, its big buffer is unchanged and its variables are as expected."""
    assert await nb.value("__import__('hashlib').sha256(big).hexdigest()") == digest
    for name, value in expect.items():
        assert await nb.value(name) == value, name


async def wait_restarted(nb: Notebook, serverapp, old_root: int | None,
                         timeout: float = 60.0) -> int:
    """Wait until the server runs a new kernel process for ``nb`` and it answers."""
    await until(lambda: (r := provisioner(serverapp, nb.kernel_id).root_pid) and r != old_root
                and psutil.pid_exists(r), timeout, "the kernel to be restarted", interval=0.05)
    # the websocket may have seen the restart: reconnect it so execute goes to the new kernel
    deadline = time.monotonic() + timeout
    while True:
        try:
            await nb.execute("1", timeout=10)
            break
        except (AssertionError, asyncio.TimeoutError):
            if time.monotonic() > deadline:
                raise
    return provisioner(serverapp, nb.kernel_id).root_pid


# --- a second real user ----------------------------------------------------------------------------
# Each test run has its own second user: suites running at once (CI is busy) never share one,
# so none can delete the account another is using.
OTHER_USER_PREFIX = "infinijup-rel-"


def ensure_other_user() -> tuple[pwd.struct_passwd, bool]:
    """This run's second user, created here (after removing those of runs that are gone);
    True when we created it."""
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: no second real user can be created")
    for entry in pwd.getpwall():
        pid = entry.pw_name.removeprefix(OTHER_USER_PREFIX)
        if entry.pw_name.startswith(OTHER_USER_PREFIX) and pid.isdigit() and \
                not psutil.pid_exists(int(pid)):
            subprocess.run(["userdel", entry.pw_name], check=False, capture_output=True)
    name = f"{OTHER_USER_PREFIX}{os.getpid()}"
    try:
        return pwd.getpwnam(name), False
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        "--uid", str(unused_uid()), name], check=True)
        return pwd.getpwnam(name), True


def remove_other_user(user: pwd.struct_passwd) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            p.uids().real == user.pw_uid for p in psutil.process_iter() if _alive(p)):
        time.sleep(0.05)
    subprocess.run(["userdel", user.pw_name], check=False)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def as_user(user: pwd.struct_passwd, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` in a forked child that has become ``user``. Returns {"value": ...} or
    {"error": reason or exception name, "message": ...}."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            try:
                out: Any = {"value": fn()}
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                out = {"error": getattr(exc, "reason", None) or type(exc).__name__,
                       "message": str(exc)}
            os.write(write_fd, json.dumps(out, default=repr).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


# --- resources ------------------------------------------------------------------------------------
def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def zombies() -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def iter_lines(path: str) -> Iterator[str]:
    with open(path, errors="replace") as f:
        yield from f


# --- a Jupyter server in its own process (so that it can be SIGKILLed) ------------------------------
USER_PYTHON = "/usr/bin/python3"


class ServerProcess:
    """``jupyter server`` with Infinijup, as a child process: token auth, its own config, data
    and runtime dirs, the given helper socket and store."""

    def __init__(self, base: Path, helper_socket: str, store: str, notebook_dir: Path,
                 extra_env: dict[str, str] | None = None, user: Any = None,
                 manager_config: dict[str, Any] | None = None) -> None:
        """``manager_config``: more SnapshotManager settings (say, ``hibernate_on_shutdown``).
        ``user``: run the server (and so its kernels) as that account, with the system
        Python and this checkout's packages on PYTHONPATH (the venv's interpreter may live
        where other accounts cannot reach, e.g. under a 0700 /root)."""
        import secrets
        import socket as _socket

        self.user = user
        self.python = sys.executable if user is None else USER_PYTHON
        self.base = base
        self.token = secrets.token_hex(16)
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.runtime = base / "runtime"
        config, data = base / "config", base / "data"
        for d in (self.runtime, config, data / "kernels" / "infinijup", notebook_dir):
            d.mkdir(parents=True, exist_ok=True)
        (data / "kernels" / "infinijup" / "kernel.json").write_text(json.dumps({
            "argv": [self.python, "-m", "infinijup.kernel_magics.launch", "-f",
                     "{connection_file}"],
            "display_name": "Python 3 (Infinijup)", "language": "python",
            "metadata": {"kernel_provisioner": {"provisioner_name": "infinijup-provisioner"}}}))
        (config / "jupyter_server_config.json").write_text(json.dumps({
            "ServerApp": {"jpserver_extensions": {"infinijup": True}, "port": self.port,
                          "ip": "127.0.0.1", "port_retries": 0, "open_browser": False,
                          "allow_root": True, "root_dir": str(notebook_dir),
                          "allow_unauthenticated_access": False},
            "IdentityProvider": {"token": self.token},
            "SnapshotManager": {"busy_timeout": BUSY_TIMEOUT, "store_path": store,
                                **(manager_config or {})}}))
        self.env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_DATA_DIR": str(data),
                    "JUPYTER_PATH": str(data), "JUPYTER_RUNTIME_DIR": str(self.runtime),
                    "INFINIJUP_HELPER_SOCKET": helper_socket, "INFINIJUP_STORE": store,
                    "INFINIJUP_RESULTS_DIR": str(base / "results"),
                    "JUPYTER_PLATFORM_DIRS": "1"}
        for name in ("INFINIJUP_SERVER_URL", "INFINIJUP_SERVER_TOKEN", "JPY_PARENT_PID"):
            self.env.pop(name, None)
        self.env.update(extra_env or {})
        self.proc: subprocess.Popen | None = None
        self.log_path = base / "server.log"
        if user is not None:
            self.env = {k: v for k, v in self.env.items() if not k.startswith(("PYTHON", "VIRTUAL"))}
            self.env.update(HOME=str(base), USER=user.pw_name, PATH="/usr/bin:/bin",
                            PYTHONPATH=user_pythonpath())
            for path in [base, *base.rglob("*"), Path(store).parent, notebook_dir]:
                os.lchown(path, user.pw_uid, user.pw_gid)

    def start(self, timeout: float = 60.0) -> None:
        self._log = open(self.log_path, "ab")
        argv = [self.python, "-m", "jupyter_server"]
        if self.user is not None:
            argv = ["setpriv", "--reuid", str(self.user.pw_uid), "--regid",
                    str(self.user.pw_gid), "--init-groups", "--", *argv]
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=str(self.base))
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.request("GET", "/api/status")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"jupyter server did not start:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 600.0, token: str | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict]:
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json", **(headers or {})}
        if token is None:
            token = self.token
        if token:
            headers["Authorization"] = f"token {token}"
        data = json.dumps(body).encode() if body is not None else (
            b"" if method == "POST" else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                return resp.status, (json.loads(raw) if raw else {})
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw)
            except ValueError:
                return exc.code, {"raw": raw.decode(errors="replace")}

    def open_session(self, path: str) -> str:
        code, body = self.request("POST", "/api/sessions", {
            "path": path, "type": "notebook", "name": path, "kernel": {"name": "infinijup"}})
        assert code == 201, body
        return body["kernel"]["id"]

    async def websocket(self, kernel_id: str):
        """The kernel's websocket, as a notebook opens it (JSON messages, the server's token)."""
        import uuid

        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = (f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels"
               f"?session_id={uuid.uuid4().hex}")
        return await websocket_connect(HTTPRequest(
            url, headers={"Authorization": f"token {self.token}"}))

    def kernel_client(self, kernel_id: str):
        """A blocking client on the kernel's own connection file (helperkit's Kernel)."""
        from helperkit import Kernel
        from jupyter_client import BlockingKernelClient

        conn = str(self.runtime / f"kernel-{kernel_id}.json")
        kc = BlockingKernelClient(connection_file=conn)
        kc.load_connection_file()
        kc.start_channels()
        kernel = Kernel(pid=0, connection_file=conn, log_path="", kc=kc)
        kernel.wait_answering(timeout=60)
        return kernel

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.wait_exited()

    def wait_exited(self, timeout: float = 120.0) -> int:
        """Wait for the server process to end (say, killed at a store crash point)."""
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        self._log.close()
        return code

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
