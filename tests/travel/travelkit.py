"""Two "machines" on one VM for the travel tests (issue 15): A runs in the VM's own namespaces,
B in a mount, UTS and network namespace of its own, held by a small holder process.

B has its own /tmp, /run and /dev/shm (fresh tmpfs), its own hostname and /etc/machine-id,
and only a loopback network: nothing of A's is reachable from it, by path or by address. Both
machines use the same layout under one path in /tmp (``ROOT``: home, helper, store,
notebooks, server), as two nodes of a cluster installed alike do; each has its own copy of it.
The only link between them is the object store: A pushes to it, and B's store is filled from
it by ``infinijup store clone`` run in B's mount namespace but the VM's network namespace (a
machine whose network reaches the object store; B's helper, server and kernels never see that
network).

Every process of a machine (helper, Jupyter server, ``infinijup store``, the test's client) is
started through ``nsenter`` into its namespaces (an empty prefix for A), so the test talks to
B's server from inside B (client.py), as a user on B would.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path.insert(0, str(TESTS / "helper"))
sys.path.insert(0, str(TESTS / "store"))
from helperkit import (  # noqa: E402
    CRIU,
    MISSING,
    PYTHON,
    checkout_closed_to,
    helper_env,
    socket_answers,
    unused_uid,
    user_pythonpath,
)
from s3server import S3Server, weed_binary  # noqa: E402 - the tests' real object store

__all__ = ["Helper", "Machine", "S3Server", "Server", "checkout_closed_to", "namespaces_missing",
           "new_root", "weed_binary"]

START_TIMEOUT = 180.0  # hang guards only: the 2-core CI machine is slow, never what decides
CALL_TIMEOUT = 600.0
# Another account's Python: the venv's interpreter may live under a 0700 /root (reliakit.py).
USER_PYTHON = "/usr/bin/python3"
USER_PREFIX = "infinijup-travel-"


def as_user(user: Any, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` (None: as root, unchanged)."""
    if user is None:
        return argv
    return ["setpriv", "--reuid", str(user.pw_uid), "--regid", str(user.pw_gid),
            "--init-groups", "--", *argv]


def user_env(user: Any, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a Python of ``user``: this checkout's packages on PYTHONPATH."""
    if user is None:
        return env
    out = {k: v for k, v in env.items() if not k.startswith(("PYTHON", "VIRTUAL"))}
    out.update(USER=user.pw_name, PATH="/usr/bin:/bin", PYTHONPATH=user_pythonpath())
    return out


def ensure_user() -> Any:
    """This run's second account (made here; those of finished runs are removed first)."""
    import pwd

    import psutil

    for entry in pwd.getpwall():
        pid = entry.pw_name.removeprefix(USER_PREFIX)
        if entry.pw_name.startswith(USER_PREFIX) and pid.isdigit() and \
                not psutil.pid_exists(int(pid)):
            subprocess.run(["userdel", entry.pw_name], check=False, capture_output=True)
    name = f"{USER_PREFIX}{os.getpid()}"
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        "--uid", str(unused_uid()), name], check=True)
        return pwd.getpwnam(name)


def remove_user(user: Any) -> None:
    """``userdel``, once the account's processes are gone (a hang guard: 60 s)."""
    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(
            _uid_of(p) == user.pw_uid for p in psutil.process_iter()):
        time.sleep(0.05)
    subprocess.run(["userdel", user.pw_name], check=False, capture_output=True)


def _uid_of(proc: Any) -> int | None:
    import psutil

    try:
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.uids().real
    except psutil.Error:
        return None


def chown_tree(path: Path, user: Any) -> None:
    if user is None:
        return
    for p in [path, *path.rglob("*")]:
        os.lchown(p, user.pw_uid, user.pw_gid)


def namespaces_missing() -> str | None:
    """Why machine B cannot be made here (None: it can)."""
    if MISSING:
        return MISSING
    for tool in ("unshare", "nsenter", "ip", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / iproute2): no namespaces for machine B"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--net", "--propagation", "private",
                            "sh", "-c", "mount -t tmpfs tmpfs /tmp && hostname probe && "
                            "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("cannot make mount, UTS and network namespaces (with a tmpfs, a hostname and "
                f"a loopback) here: a restricted container? {probe.stderr.strip()}")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_tmpfs(base: str, mode: str, hold: Path) -> list[str]:
    """Shell lines (run in B's new mount namespace) that put a fresh tmpfs on ``base`` but keep
    this checkout and its Python environment where they are when they live under ``base`` (a
    clone in /tmp, as CI's may be): the old ``base`` is bound aside under ``hold`` first, and
    those paths are bound back onto the new tmpfs. The rest of the old ``base`` stays hidden."""
    keep = sorted({str(q) for q in (TESTS.parent, Path(sys.prefix))
                   if Path(q).is_relative_to(base)})
    keep = [q for q in keep if not any(q != k and Path(q).is_relative_to(k) for k in keep)]
    mount = f"mount -t tmpfs -o mode={mode} tmpfs {base}"
    if not keep:
        return [mount]
    aside = shlex.quote(str(hold / base.strip("/").replace("/", "_")))
    lines = [f"mkdir -p {aside}", f"mount --bind {base} {aside}", mount]
    for q in keep:
        inside = shlex.quote(f"{hold / base.strip('/').replace('/', '_')}/{Path(q).relative_to(base)}")
        lines += [f"mkdir -p {shlex.quote(q)}", f"mount --bind {inside} {shlex.quote(q)}"]
    return [*lines, f"umount {aside}"]


class Machine:
    """One machine: its namespaces (``holder`` is None for the VM's own) and its ``ROOT``."""

    def __init__(self, name: str, root: Path, holder: subprocess.Popen | None = None,
                 hostname: str | None = None, machine_id: str | None = None) -> None:
        self.name, self.root, self.holder = name, root, holder
        self.hostname = hostname or socket.gethostname()
        self.machine_id = machine_id
        self.procs: list[subprocess.Popen] = []
        self.daemons: list[subprocess.Popen] = []  # helpers: stopped after everything else

    # --- namespaces ---------------------------------------------------------------------------
    @classmethod
    def own(cls, name: str, root: Path) -> Machine:
        """A machine in namespaces of its own (see the module docs)."""
        hostname = f"{name}-{secrets.token_hex(3)}"
        machine_id = secrets.token_hex(16) if os.path.exists("/etc/machine-id") else None
        hold = Path(tempfile.mkdtemp(prefix="infinijup-b-", dir="/var/tmp"))
        setup = "; ".join([
            "set -e",
            *fresh_tmpfs("/tmp", "1777", hold),
            *fresh_tmpfs("/run", "0755", hold),
            *fresh_tmpfs("/dev/shm", "1777", hold),
            *([f"echo {machine_id} > /run/machine-id",
               "mount --bind /run/machine-id /etc/machine-id"] if machine_id else []),
            f"hostname {hostname}",
            "ip link set lo up",
            f"mkdir -p -m 0755 {root}",
            "echo ready",
            "exec cat",  # holds the namespaces until the test closes its stdin
        ])
        holder = subprocess.Popen(
            ["unshare", "--mount", "--uts", "--net", "--propagation", "private",
             "sh", "-c", setup], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        line = _read_line(holder.stdout, START_TIMEOUT)
        shutil.rmtree(hold, ignore_errors=True)  # empty here: its mounts were B's alone
        if line.strip() != "ready":
            holder.kill()
            raise RuntimeError(f"machine {name}: namespaces not set up: {line!r} "
                               f"{holder.stderr.read()}")
        return cls(name, root, holder, hostname, machine_id)

    def enter(self, *, net: bool = True) -> list[str]:
        """The prefix that runs a command in this machine (``net=False``: its files, the VM's
        network: how B's store is filled from the object store)."""
        if self.holder is None:
            return []
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--uts",
                *(["--net"] if net else []), "--"]

    def path(self, inside: str | Path) -> Path:
        """Where the test (in the VM's namespaces) finds this machine's ``inside``."""
        if self.holder is None:
            return Path(inside)
        return Path(f"/proc/{self.holder.pid}/root") / Path(inside).relative_to("/")

    def spawn(self, argv: list[str], *, env: dict[str, str] | None = None,
              log: Path | None = None, net: bool = True, daemon: bool = False,
              **kwargs: Any) -> subprocess.Popen:
        out = open(self.path(log), "ab") if log is not None else None  # noqa: SIM115
        if out is not None:
            kwargs.update(stdout=out, stderr=subprocess.STDOUT)
        try:
            proc = subprocess.Popen(self.enter(net=net) + argv, env=env, **kwargs)
        finally:
            if log is not None:
                out.close()
        (self.daemons if daemon else self.procs).append(proc)
        return proc

    def run(self, argv: list[str], *, env: dict[str, str] | None = None, net: bool = True,
            timeout: float = CALL_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.enter(net=net) + argv, env=env, capture_output=True,
                              text=True, timeout=timeout)

    def close(self) -> None:
        # servers first: they shut their kernels down through the helper
        for proc in [*reversed(self.procs), *reversed(self.daemons)]:
            _stop(proc)
        if self.holder is not None:
            self._kill_leftovers()
            self.holder.stdin.close()
            _stop(self.holder)
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """SIGKILL what still runs in this machine's UTS namespace (only this test's processes
        are there: kernels a failed test left behind), so that nothing outlives the test."""
        assert self.holder is not None
        try:
            ours = os.readlink(f"/proc/{self.holder.pid}/ns/uts")
        except OSError:
            return
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.holder.pid:
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/uts") == ours:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue

    # --- the layout ------------------------------------------------------------------------------
    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def notebooks(self) -> Path:
        return self.root / "notebooks"

    @property
    def store(self) -> Path:
        return self.home / ".local" / "share" / "infinijup" / "store"  # the default one

    def store_argv(self, *args: str, user: Any = None) -> list[str]:
        """``infinijup store ...`` on this machine's store (as ``user``: ``python -m``)."""
        if user is None:
            exe = [str(Path(sys.executable).parent / "infinijup"), "store"]
        else:
            exe = as_user(user, [USER_PYTHON, "-m", "infinijup.store"])
        return [*exe, "--store", str(self.store), *args]

    def store_cli(self, *args: str, env: dict[str, str] | None = None, user: Any = None
                  ) -> subprocess.CompletedProcess[str]:
        """``infinijup store ...`` on this machine's files (the VM's network: see above)."""
        return self.run(self.store_argv(*args, user=user),
                        env=user_env(user, env or dict(os.environ)), net=False)


def _read_line(stream: Any, timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no answer within {timeout} s")
    return stream.readline()


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Helper:
    """A real helper daemon of one machine, at ``ROOT/helper`` (the same path on each)."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.base = machine.root / "helper"
        self.socket_path = str(self.base / "run" / "helper.sock")
        self.work_dir = str(self.base / "work")
        self.log_path = self.base / "helper.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.machine.path(self.base).mkdir(mode=0o755, parents=True, exist_ok=True)
        argv = [PYTHON, "-m", "infinijup_helper", "--socket", self.socket_path,
                "--work", self.work_dir, "--criu", CRIU,
                *os.environ.get("INFINIJUP_TEST_HELPER_ARGS", "").split()]
        self.proc = self.machine.spawn(argv, env=helper_env(), log=self.log_path, cwd="/",
                                       daemon=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not socket_answers(str(self.machine.path(self.socket_path))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"helper of {self.machine.name} did not start:\n{self.log()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def log(self) -> str:
        try:
            return self.machine.path(self.log_path).read_text(errors="replace")[-5000:]
        except OSError:
            return ""


class Server:
    """``jupyter server`` with Infinijup on one machine (token auth, its own dirs, the
    machine's helper and store, HOME at ``ROOT/home``), and a client inside the machine."""

    def __init__(self, machine: Machine, helper: Helper, user: Any = None) -> None:
        self.machine, self.user = machine, user
        python = PYTHON if user is None else USER_PYTHON
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = machine.root / "server"
        self.runtime = self.base / "runtime"
        config, data = self.base / "config", self.base / "data"
        for d in (self.runtime, config, data / "kernels" / "infinijup", machine.notebooks,
                  machine.home):
            machine.path(d).mkdir(mode=0o755, parents=True, exist_ok=True)
        machine.path(data / "kernels" / "infinijup" / "kernel.json").write_text(json.dumps({
            "argv": [python, "-m", "infinijup.kernel_magics.launch", "-f", "{connection_file}"],
            "display_name": "Python 3 (Infinijup)", "language": "python",
            "metadata": {"kernel_provisioner": {"provisioner_name": "infinijup-provisioner"}}}))
        machine.path(config / "jupyter_server_config.json").write_text(json.dumps({
            "ServerApp": {"jpserver_extensions": {"infinijup": True}, "port": self.port,
                          "ip": "127.0.0.1", "port_retries": 0, "open_browser": False,
                          "allow_root": True, "root_dir": str(machine.notebooks),
                          "allow_unauthenticated_access": False},
            "IdentityProvider": {"token": self.token},
            "SnapshotManager": {"busy_timeout": 60.0, "store_path": str(machine.store)}}))
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("INFINIJUP_", "JUPYTER", "JPY_"))}
        self.env.update({
            "HOME": str(machine.home), "JUPYTER_CONFIG_DIR": str(config),
            "JUPYTER_DATA_DIR": str(data), "JUPYTER_PATH": str(data),
            "JUPYTER_RUNTIME_DIR": str(self.runtime), "JUPYTER_PLATFORM_DIRS": "1",
            "INFINIJUP_HELPER_SOCKET": helper.socket_path, "INFINIJUP_STORE": str(machine.store),
            "INFINIJUP_RESULTS_DIR": str(self.base / "results"),
            "INFINIJUP_CRIU": CRIU})
        self.env = user_env(user, self.env)
        self.argv = as_user(user, [python, "-m", "jupyter_server"])
        for d in (self.base, machine.home, machine.notebooks):
            chown_tree(machine.path(d), user)
        self.log_path = self.base / "server.log"
        self.proc: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = self.machine.spawn(self.argv, env=self.env, log=self.log_path, cwd="/")
        self.client = self.machine.spawn(  # root: it reads the user's connection files
            [PYTHON, str(HERE / "client.py"), self.url, self.token, str(self.runtime)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        answer = self.call("wait_ready", timeout=START_TIMEOUT)
        if "error" in answer or self.proc.poll() is not None:
            raise RuntimeError(f"jupyter server of {self.machine.name} did not start: "
                               f"{answer}\n{self.log()}")

    def stop(self) -> None:
        if self.client is not None:
            self.client.stdin.close()
            _stop(self.client)
        if self.proc is not None:
            _stop(self.proc)

    def log(self) -> str:
        try:
            return self.machine.path(self.log_path).read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    # --- through the client on the machine -----------------------------------------------------
    def call(self, op: str, **args: Any) -> dict:
        assert self.client is not None and self.client.stdin is not None
        self.client.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.client.stdin.flush()
        line = _read_line(self.client.stdout, CALL_TIMEOUT)
        if not line:
            raise RuntimeError(f"the client on {self.machine.name} exited\n{self.log()}")
        return json.loads(line)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        answer = self.call("request", method=method, path=path, body=body)
        assert "error" not in answer, answer
        return answer["code"], answer["body"]

    def open_session(self, path: str) -> str:
        code, body = self.request("POST", "/api/sessions", {
            "path": path, "type": "notebook", "name": path, "kernel": {"name": "infinijup"}})
        assert code == 201, body
        return body["kernel"]["id"]

    def evaluate(self, kernel_id: str, **expressions: str) -> dict[str, str]:
        answer = self.call("evaluate", kernel_id=kernel_id, expressions=expressions)
        assert "values" in answer, f"{answer}\n{self.log()}"
        return answer["values"]

    def value(self, kernel_id: str, expression: str) -> str:
        return self.evaluate(kernel_id, v=expression)["v"]

    def execute(self, kernel_id: str, code: str, timeout: float = 120.0) -> dict:
        answer = self.call("execute", kernel_id=kernel_id, code=code, timeout=timeout)
        assert "content" in answer, f"{answer}\n{self.log()}"
        return answer["content"]


def new_root() -> Path:
    """The layout's path, the same on every machine (in /tmp, which B has its own of)."""
    return Path("/tmp") / f"ij-travel-{os.getpid()}-{uuid.uuid4().hex[:8]}"
