"""Bad input on the socket gets an error and never hurts the daemon; instance management."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helperkit import (
    CRIU,
    PYTHON,
    HelperDaemon,
    helper_env,
    kernel_env,
    make_base,
    needs_root_and_criu,
    socket_answers,
    wait_for,
)

pytestmark = needs_root_and_criu


def _raw(path: str, payload: bytes, *, read: bool = True, timeout: float = 10) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(payload)
        if not read:
            return []
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines()]


def _hello_ok(path: str) -> bool:
    (reply,) = _raw(path, b'{"v":1,"id":5,"op":"hello","args":{}}\n')
    return reply == {**reply, "id": 5, "ok": True}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"this is not json\n", "bad_request"),
        (b'{"v": 9, "id": 1, "op": "hello", "args": {}}\n', "protocol_version"),
        (b'{"v": 1, "id": 1, "op": "format_disk", "args": {}}\n', "unknown_op"),
        (b'{"v": 1, "id": 1, "op": "kill", "args": {"pid": "1"}}\n', "bad_request"),
        (
            b'{"v": 1, "id": 1, "op": "dump", "args": {"pid": 1, "images_dir": "/tmp/x", "extra": 1}}\n',
            "bad_request",
        ),
        (b"\n", "bad_request"),
    ],
)
def test_bad_request_gets_error_and_daemon_serves_next(
    helper: HelperDaemon, payload: bytes, reason: str
) -> None:
    replies = _raw(helper.socket_path, payload + b'{"v":1,"id":2,"op":"hello","args":{}}\n')
    assert replies[0]["ok"] is False and replies[0]["error"]["reason"] == reason
    assert replies[1]["id"] == 2 and replies[1]["ok"] is True
    assert _hello_ok(helper.socket_path)


def test_huge_line_is_refused_and_connection_closed(helper: HelperDaemon) -> None:
    payload = b'{"v":1,"id":1,"op":"hello","args":{"pad":"' + b"x" * (2 * 1024 * 1024) + b'"}}\n'
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(helper.socket_path)
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the helper may close before we finish writing
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    (reply,) = [json.loads(line) for line in data.splitlines()]
    assert reply["error"]["reason"] == "request_too_large"
    assert _hello_ok(helper.socket_path)


def test_client_vanishing_mid_op_does_not_hurt(helper: HelperDaemon, client, trees) -> None:
    work = client.work_dir()
    root = trees.add(
        client.spawn(
            [PYTHON, "-c", "import time; time.sleep(3600)"],
            kernel_env(),
            work,
            os.path.join(work, "v.log"),
        )
    )
    images = os.path.join(work, f"vanish-{root}")
    request = {"v": 1, "id": 1, "op": "dump", "args": {"pid": root, "images_dir": images}}
    _raw(helper.socket_path, json.dumps(request).encode() + b"\n", read=False)  # hang up at once
    wait_for(lambda: os.path.isdir(images), what="the abandoned dump to finish")
    assert client.status(root).alive
    client.kill(root)
    client.release(images)
    assert _hello_ok(helper.socket_path)


def test_many_concurrent_connections(helper: HelperDaemon) -> None:
    socks = []
    for _ in range(20):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(helper.socket_path)
        s.sendall(b'{"v":1,"id":1,')  # half a request, then silence
        socks.append(s)
    try:
        assert _hello_ok(helper.socket_path)
    finally:
        for s in socks:
            s.close()


def test_second_start_says_already_running(helper: HelperDaemon) -> None:
    done = subprocess.run(
        helper.argv(), env=helper_env(), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0
    assert "already running" in done.stdout
    assert _hello_ok(helper.socket_path)


def test_refuses_to_start_without_root() -> None:
    # Imported before dropping to nobody: the checkout may be where nobody cannot read it
    # (a clone under a 0700 /root); what is tested is the helper's refusal, not the import.
    from infinijup_helper.__main__ import main

    base = make_base()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that drops to nobody and calls main() in-process
        code = 99
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with open(write_fd, "w") as err, contextlib.redirect_stderr(err):
                code = main(
                    [
                        "--socket",
                        str(base / "s.sock"),
                        "--work",
                        str(base / "w"),
                        "--criu",
                        "/bin/true",
                    ]
                )
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert "must run as root" in err and "sudo make helper" in err
    assert not os.path.exists(base / "s.sock")
    shutil.rmtree(base)


def test_daemon_mode_pidfile_and_stop() -> None:
    daemon = HelperDaemon(make_base())
    pidfile = str(daemon.base / "helper.pid")
    log = str(daemon.base / "daemon.log")
    argv = daemon.argv("--daemon", "--pidfile", pidfile, "--log", log)
    done = subprocess.run(argv, env=helper_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "started" in done.stdout
    assert socket_answers(daemon.socket_path)
    pid = int(open(pidfile).read())
    again = subprocess.run(argv, env=helper_env(), capture_output=True, text=True, timeout=30)
    assert again.returncode == 0 and "already running" in again.stdout
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not socket_answers(daemon.socket_path)
    assert not os.path.exists(pidfile)
    assert "ready" in open(log).read()
    shutil.rmtree(daemon.base)


def test_installed_helper_runs_from_a_root_only_copy(other_account) -> None:
    """``sudo make helper`` copies the helper and all it imports to a root-owned prefix and
    runs it from there (scripts/install_helper.py): no file root runs is writable by anyone
    else, and a root tree and a plain account's tree round-trip through that copy."""
    import pwd
    import tempfile

    from helperkit import REPO, as_user

    from infinijup.helper_client import HelperClient

    parent = Path(tempfile.mkdtemp(prefix="infinijup-install-", dir="/var/lib"))
    os.chmod(parent, 0o755)
    prefix = parent / "helper"
    try:
        done = subprocess.run([PYTHON, str(REPO / "scripts" / "install_helper.py"), "--prefix",
                               str(prefix)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        entry = Path(done.stdout.strip())
        assert entry == prefix / "bin" / "infinijup-helper"
        for path in [prefix, *prefix.rglob("*")]:
            st = path.lstat()
            assert st.st_uid == 0 and not st.st_mode & 0o022, path
        # Of the checkout, only the helper: it imports nothing of the infinijup package.
        assert (prefix / "lib" / "infinijup_helper" / "cuda_stage.py").is_file()
        assert not (prefix / "lib" / "infinijup").exists()
        base = make_base()
        daemon = HelperDaemon(base)
        daemon.argv = lambda *extra: [str(entry), "--socket", daemon.socket_path,  # type: ignore
                                      "--work", daemon.work_dir, "--criu", CRIU, *extra]
        daemon.start()
        try:
            cmdline = Path(f"/proc/{daemon.proc.pid}/cmdline").read_bytes().split(b"\0")
            assert cmdline[1:3] == [b"-I", str(entry).encode()], cmdline
            client = HelperClient(daemon.socket_path, timeout=120)
            work = client.work_dir()
            root = client.spawn([PYTHON, "-c", "import time; time.sleep(600)"], kernel_env(),
                                work, f"{work}/i.log")
            client.dump(root, f"{work}/img")
            client.kill(client.restore(f"{work}/img", replace_pid=root).pid)
            user_work = as_user(other_account, client.work_dir)["value"]
            spawned = as_user(other_account, lambda: client.spawn(
                ["/usr/bin/python3", "-c", "import time; time.sleep(600)"],
                {"PATH": "/usr/bin:/bin"}, user_work, f"{user_work}/i.log"))
            assert "value" in spawned, spawned
            tree = spawned["value"]
            dumped = as_user(other_account, lambda: client.dump(tree, f"{user_work}/img").__dict__)
            assert "value" in dumped, dumped
            assert as_user(other_account, lambda: client.kill(tree)) == {"value": None}
            assert pwd.getpwuid(os.stat(f"{user_work}/img").st_uid).pw_uid == \
                other_account.pw_uid
        finally:
            daemon.stop()
            shutil.rmtree(base, ignore_errors=True)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
