"""Fixtures and tools for the helper's tests: a real helper daemon on a temp socket, real kernels.

Nothing is mocked. Tests that need root or CRIU are skipped, with the reason, when either is
missing; the protocol parser tests run anywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
CRIU = os.environ.get("INFINIJUP_CRIU") or "/opt/infinijup/criu/sbin/criu"
PYCRIU = os.environ.get("INFINIJUP_PYCRIU") or "/opt/infinijup/criu/python"
# This run's second account: suites running at once (a busy CI machine) never share one, so none
# can delete the account another is using. Those of runs that are gone are removed (ensure_user).
OTHER_USER_PREFIX = "infinijup-test-"
OTHER_USER = f"{OTHER_USER_PREFIX}{os.getpid()}"


def _missing_requirement() -> str | None:
    if os.geteuid() != 0:
        return "the helper tests need root (CRIU, PID namespaces): run them with sudo"
    if not os.access(CRIU, os.X_OK):
        return f"CRIU not found at {CRIU}: run `sudo make criu` (or set INFINIJUP_CRIU)"
    if not os.path.isdir(os.path.join(PYCRIU, "pycriu")):
        return f"pycriu not found in {PYCRIU}: run `sudo make criu` (or set INFINIJUP_PYCRIU)"
    return None


MISSING = _missing_requirement()
needs_root_and_criu = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def helper_env() -> dict[str, str]:
    env = dict(os.environ)
    env["INFINIJUP_CRIU"] = CRIU
    env["INFINIJUP_PYCRIU"] = PYCRIU
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def socket_answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


@dataclass
class HelperDaemon:
    """One real helper process, serving ``socket_path`` with work root ``work_dir``."""

    base: Path
    socket_path: str = ""
    work_dir: str = ""
    log_path: str = ""
    proc: subprocess.Popen | None = None
    extra_args: tuple[str, ...] = ()  # more command-line options (limits, timeouts)
    extra_env: dict[str, str] = field(default_factory=dict)
    _log: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.socket_path = str(self.base / "run" / "helper.sock")
        self.work_dir = str(self.base / "work")
        self.log_path = str(self.base / "helper.log")

    def argv(self, *extra: str) -> list[str]:
        return [
            PYTHON, "-m", "infinijup_helper",
            "--socket", self.socket_path, "--work", self.work_dir, "--criu", CRIU,
            *os.environ.get("INFINIJUP_TEST_HELPER_ARGS", "").split(), *extra,
        ]  # fmt: skip

    def start(self, timeout: float = 20.0) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv(*self.extra_args), env={**helper_env(), **self.extra_env},
            stdout=self._log, stderr=subprocess.STDOUT, cwd="/",
        )
        deadline = time.monotonic() + timeout
        while not socket_answers(self.socket_path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"helper exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"helper did not start:\n{self.log()}")
            time.sleep(0.05)
        # The socket listens from bind() on, before the helper has done what it does at start
        # (the registry, the GPU arena and its sweep): a request is answered only once it serves
        # (trees: one that changes nothing, unlike hello, which mounts the caller's arena).
        from infinijup.helper_client import HelperClient

        HelperClient(self.socket_path, timeout=max(1.0, deadline - time.monotonic())).trees()

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


    def remove(self) -> None:
        remove_helper_base(self.base)


def remove_helper_base(base: Path) -> None:
    """A stopped helper's files, and the GPU arena it mounted beside its socket (where CUDA is
    usable, or with ``--gpu-arena always``)."""
    arena = base / "run" / "gpu-arena"
    if os.path.ismount(arena):
        subprocess.run(["umount", "-l", str(arena)], check=False, capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


def make_base() -> Path:
    """A temp dir other users can traverse (the socket must be reachable by them)."""
    base = Path(tempfile.mkdtemp(prefix="ijh-"))
    os.chmod(base, 0o755)
    return base


@contextlib.contextmanager
def own_helper(*extra_args: str, holds: bool = False) -> Iterator[HelperDaemon]:
    """A helper of a test module's own: other options, hold points (``holds``: its
    ``holds_dir``, infinijup_helper/holds.py)."""
    holds_dir = Path(make_base()) / "holds" if holds else None
    extra_env = {}
    if holds_dir is not None:
        holds_dir.mkdir()
        extra_env["INFINIJUP_HELPER_HOLDS"] = str(holds_dir)
    daemon = HelperDaemon(make_base(), extra_args=extra_args, extra_env=extra_env)
    daemon.holds_dir = str(holds_dir) if holds_dir is not None else None  # type: ignore[attr-defined]
    daemon.start()
    try:
        yield daemon
    finally:
        if holds_dir is not None:
            for entry in holds_dir.iterdir():
                entry.unlink()
        daemon.stop()
        shutil.rmtree(daemon.base, ignore_errors=True)
        if holds_dir is not None:
            shutil.rmtree(holds_dir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def helper() -> Iterator[HelperDaemon]:
    if MISSING:
        pytest.skip(MISSING)
    daemon = HelperDaemon(make_base())
    daemon.start()
    yield daemon
    daemon.stop()
    daemon.remove()


@pytest.fixture
def client(helper: HelperDaemon):
    from infinijup.helper_client import HelperClient

    return HelperClient(helper.socket_path, timeout=120)


class Trees:
    """Remembers trees a test started and kills whatever is left of them afterwards."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    def add(self, pid: int) -> int:
        self.pids.append(pid)
        return pid

    def cleanup(self) -> None:
        """SIGKILL every tree still running and wait until it is gone (the helper reaps it).
        Its descendants too: without a PID namespace (``--pid-namespace never``, the GPU
        hosts) the root's death does not end them."""
        for pid in [d for root in self.pids for d in _descendants(root)] + self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for pid in self.pids:
            while time.monotonic() < deadline:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            break
                except (FileNotFoundError, ProcessLookupError):  # gone (or going: ESRCH)
                    break
                time.sleep(0.01)


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return [d for c in children for d in (c, *_descendants(c))]


@pytest.fixture
def trees() -> Iterator[Trees]:
    t = Trees()
    yield t
    t.cleanup()


def kernel_env() -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    if os.environ.get("PYTHONPATH"):  # where ipykernel is installed beside the system's Python
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]  # (the GPU machine: .carry/setup.sh)
    return env


@dataclass
class Kernel:
    pid: int
    connection_file: str
    log_path: str
    kc: Any  # BlockingKernelClient

    def execute(self, code: str, timeout: float = 20.0) -> dict[str, Any]:
        """Run code; return the shell reply's content (user_expressions included)."""
        return self.execute_with(code, {}, timeout)

    def execute_with(
        self, code: str, expressions: dict[str, str], timeout: float = 20.0
    ) -> dict[str, Any]:
        msg_id = self.kc.execute(code, user_expressions=expressions, store_history=False)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                assert reply["content"]["status"] == "ok", reply["content"]
                return reply["content"]

    def evaluate(self, **expressions: str) -> dict[str, str]:
        content = self.execute_with("", expressions)
        out = {}
        for name, value in content["user_expressions"].items():
            assert value["status"] == "ok", value
            out[name] = value["data"]["text/plain"]
        return out

    def wait_answering(self, timeout: float = 120.0) -> float:
        """Send kernel_info requests until a shell reply *and* an iopub status message for the
        same request arrive. After a restore the client's ZMQ sockets reconnect and the first
        messages can be lost (slow joiner), so one request is not enough."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            msg_id = self.kc.kernel_info()
            got_reply = got_status = False
            until = time.monotonic() + 1.0
            while time.monotonic() < until and not (got_reply and got_status):
                for channel, flag in (
                    (self.kc.shell_channel, "reply"),
                    (self.kc.iopub_channel, "status"),
                ):
                    try:
                        msg = channel.get_msg(timeout=0.05)
                    except queue.Empty:
                        continue
                    if msg["parent_header"].get("msg_id") != msg_id:
                        continue
                    if flag == "reply" and msg["msg_type"] == "kernel_info_reply":
                        got_reply = True
                    if flag == "status" and msg["msg_type"] == "status":
                        got_status = True
            if got_reply and got_status:
                return time.monotonic() - start
        raise TimeoutError(f"kernel did not answer within {timeout} s")

    def close(self) -> None:
        self.kc.stop_channels()


def start_kernel(client: Any, trees: Trees, name: str = "kernel") -> Kernel:
    from jupyter_client import BlockingKernelClient
    from jupyter_client.connect import write_connection_file

    work = client.work_dir()
    conn = os.path.join(work, f"{name}-{os.getpid()}-{time.monotonic_ns()}.json")
    write_connection_file(conn, ip="127.0.0.1")
    log_path = conn[:-5] + ".log"
    pid = trees.add(
        client.spawn([PYTHON, "-m", "ipykernel_launcher", "-f", conn], kernel_env(), work, log_path)
    )
    kc = BlockingKernelClient(connection_file=conn)
    kc.load_connection_file()
    kc.start_channels()
    kernel = Kernel(pid=pid, connection_file=conn, log_path=log_path, kc=kc)
    kernel.wait_answering(timeout=30)
    return kernel


@pytest.fixture
def kernel(client: Any, trees: Trees) -> Iterator[Kernel]:
    k = start_kernel(client, trees)
    yield k
    k.close()


def wait_for(predicate: Any, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def read_nspid(pid: int) -> list[int]:
    """The NSpid line of /proc/PID/status: the pid in each namespace, outermost first."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no NSpid for {pid}")


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):  # a process being reaped reads ESRCH
        pass
    return out


# A process tree for round trips: a parent reading fixed-width records from a file it holds open
# (unbuffered, so the offset lives in the kernel), one child, and a SIGUSR1 handler that reads
# and prints the next record.
READER_SCRIPT = """\
import os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
for _ in range(3):
    os.read(fd, 5)
child = os.fork()
if child == 0:
    while True:
        time.sleep(1)
def on_usr1(signum, frame):
    print("read " + os.read(fd, 5).decode().strip(), flush=True)
signal.signal(signal.SIGUSR1, on_usr1)
print("ready", flush=True)
while True:
    signal.pause()
"""


# --- a second real account -------------------------------------------------------------------------
def ensure_user(name: str = OTHER_USER) -> tuple[Any, bool]:
    """The account ``name`` (created, no home, no login shell, when missing); True if created."""
    import pwd

    for entry in pwd.getpwall():
        run = entry.pw_name.removeprefix(OTHER_USER_PREFIX)
        if entry.pw_name.startswith(OTHER_USER_PREFIX) and run.isdigit() and \
                not os.path.exists(f"/proc/{run}"):
            subprocess.run(["userdel", entry.pw_name], check=False, capture_output=True)
    try:
        return pwd.getpwnam(name), False
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: no second real account can be created")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "--uid", str(unused_uid()), name], check=True)
    return pwd.getpwnam(name), True


def unused_uid(first: int = 20000, last: int = 59999) -> int:
    """A uid no account has and no process runs as. useradd alone would hand out the uid of
    an account removed a moment ago, whose processes may still be exiting (or be another run's
    leftovers): the new account would then own them, and a test counting its processes would
    count theirs."""
    import pwd

    taken = {e.pw_uid for e in pwd.getpwall()}
    for pid in os.listdir("/proc"):
        try:
            taken.add(os.stat(f"/proc/{pid}").st_uid if pid.isdigit() else -1)
        except OSError:
            continue
    for uid in range(first, last + 1):
        if uid not in taken:
            return uid
    raise RuntimeError(f"no free uid in {first}..{last}")


def remove_user(user: Any, timeout: float = 60.0) -> None:
    """userdel, once none of the account's processes is left (killed trees take a moment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
            os.stat(f"/proc/{p}").st_uid == user.pw_uid
            for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}")):
        time.sleep(0.05)
    subprocess.run(["userdel", user.pw_name], check=False)


@pytest.fixture(scope="session")
def other_account() -> Iterator[Any]:
    """The second real account of the tests (``infinijup-test-other``)."""
    if MISSING:
        pytest.skip(MISSING)
    user, created = ensure_user()
    yield user
    if created:
        remove_user(user)


def as_user(user: Any, fn: Any) -> dict[str, Any]:
    """Run ``fn`` in a forked child that has become ``user`` (uid, gid, no other groups).
    Returns {"value": ...} or {"error": reason or exception name, "message": ...}."""
    import json

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


def user_pythonpath() -> str:
    """This checkout and its venv's packages (and pycriu), for another account's Python."""
    import sysconfig

    return os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"], PYCRIU])


def checkout_closed_to(user: Any) -> str | None:
    """Why ``user`` cannot run this checkout's Jupyter server (None: it can). The second
    accounts' servers run the system Python on the checkout and its venv's packages, which a
    clone under a 0700 directory (root's home) keeps from them; their tests skip, saying so."""
    paths = user_pythonpath().split(os.pathsep)
    closed = as_user(user, lambda: [p for p in paths if not os.access(p, os.R_OK | os.X_OK)])
    if closed.get("value") == []:
        return None
    return (f"{closed.get('value') or closed} cannot be read by {user.pw_name}: a second account "
            "cannot run this checkout's Jupyter server (clone it where other accounts can read "
            "it, e.g. under /opt or /srv)")


def user_argv(user: Any, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` (through setpriv: the test process is threaded)."""
    return ["setpriv", "--reuid", str(user.pw_uid), "--regid", str(user.pw_gid),
            "--clear-groups", "--", *argv]


# --- what the attack tests hold and watch ------------------------------------------------------
SYSTEM_PYTHON = "/usr/bin/python3"  # an account's kernel: a Python every user can run

# A kernel-shaped process of the attacker: holds what its mode says inside directory d.
HOLDER = r"""
import os, socket, sys, time
d, mode = sys.argv[1], sys.argv[2]
keep = []
if mode == "file":
    keep.append(os.open(os.path.join(d, "passwd"), os.O_RDWR))
elif mode == "socket":
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(d, "helper.sock"))
    s.listen()
    keep.append(s)
elif mode == "ghost":
    fd = os.open(os.path.join(d, "ghost"), os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"planted by the attacker\n")
    os.unlink(os.path.join(d, "ghost"))
    keep.append(fd)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def snapshot_of(path: str) -> tuple[Any, ...]:
    """What must not change about a file: bytes, owner, group, mode, inode."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ("missing",)
    data = b""
    if stat.S_ISREG(st.st_mode):
        data = hashlib.sha256(Path(path).read_bytes()).digest()
    return (data, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), stat.S_IFMT(st.st_mode),
            st.st_ino)


