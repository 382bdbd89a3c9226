"""Issue 26: what a kernel inherits from its caller (cgroup v2, resource limits) is fixed when the
caller's connection is accepted, and a kernel runs in its caller's cgroup or not at all.

A real second account connects from a process in a cgroup of the test's, hands the connected
socket on to a child (a fork) and exits; the child sends ``spawn`` and ``restore``. Either the
kernel lands in the cgroup of the process that connected, or the op is refused: never in the
helper's cgroup. No step waits for a delay: the connector's exit is waited for, and the helper
is stopped at the point where it accepted a connection (holds.py) where the test needs it to be
there.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helperkit import (
    SYSTEM_PYTHON,
    HelperDaemon,
    as_user,
    children_of,
    make_base,
    needs_root_and_criu,
    wait_for,
)

pytestmark = needs_root_and_criu

SLEEPER = [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"]
ENV = {"PATH": "/usr/bin:/bin"}


def _cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"{pid} has no cgroup v2 line")


@pytest.fixture
def cgroups() -> Iterator[tuple[Path, Path]]:
    """Two fresh cgroups (v2) beside the test's: where the connector runs, and where its
    child is moved."""
    from infinijup_helper.cgroups import unified_mount

    mount = unified_mount()
    if mount is None:
        pytest.skip("no cgroup v2 (unified) hierarchy is mounted on this machine")
    made: list[Path] = []
    try:
        for kind in ("conn", "child"):
            group = Path(mount) / f"ijcaller-{kind}-{secrets.token_hex(4)}"
            try:
                group.mkdir()
            except OSError as exc:
                pytest.skip(f"cannot make a cgroup under {mount}: {exc.strerror}")
            made.append(group)
        yield made[0], made[1]
    finally:
        for group in made:
            if group.exists():
                wait_for(lambda group=group: not (group / "cgroup.procs").read_text().strip(),
                         timeout=60, what=f"{group} to empty")
                group.rmdir()


@pytest.fixture
def holding() -> Iterator[tuple[HelperDaemon, Path]]:
    """A helper of this test's with hold points (infinijup_helper/holds.py)."""
    holds_base = make_base()
    holds = holds_base / "holds"
    holds.mkdir()
    daemon = HelperDaemon(make_base(), extra_env={"INFINIJUP_HELPER_HOLDS": str(holds)})
    daemon.start()
    yield daemon, holds
    for entry in holds.iterdir():
        entry.unlink()
    daemon.stop()
    daemon.remove()
    shutil.rmtree(holds_base, ignore_errors=True)


def _call(sock: socket.socket, replies: Any, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """One request on an open connection; its final reply line."""
    sock.sendall(json.dumps({"v": 1, "id": 1, "op": op, "args": args}).encode() + b"\n")
    while True:
        line = replies.readline()
        if not line:
            return {"ok": False, "error": {"reason": "helper_disconnected", "message": ""}}
        message = json.loads(line)
        if message.get("event") is None:
            return message


class HandedOn:
    """A connection to the helper made by one process, the *connector* (in cgroup ``procs``,
    as ``user``), which forks a child that keeps the socket and exits; the child sends what
    :meth:`call` asks for. With ``hello`` the connector first has a reply to ``hello`` (so
    the helper has accepted its connection) before it hands the socket on."""

    def __init__(self, socket_path: str, user: Any, procs: str, *, hello: bool) -> None:
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        info_r, info_w = os.pipe()
        connector = os.fork()
        if connector == 0:
            try:
                os.close(cmd_w)
                os.close(out_r)
                os.close(info_r)
                with open(procs, "w") as f:
                    f.write("0")
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(socket_path)
                replies = sock.makefile("rb")
                if hello:
                    _call(sock, replies, "hello", {})
                child = os.fork()
                if child == 0:  # the socket's new holder: runs commands until told to stop
                    os.close(info_w)
                    with os.fdopen(cmd_r, "rb") as commands:
                        for line in commands:
                            op, args = json.loads(line)
                            reply = json.dumps(_call(sock, replies, op, args)).encode()
                            os.write(out_w, reply + b"\n")
                    os._exit(0)
                os.write(info_w, str(child).encode())
            finally:
                os._exit(0)
        os.close(cmd_r)
        os.close(out_w)
        os.close(info_w)
        self.connector = connector
        with os.fdopen(info_r) as f:
            self.child = int(f.read() or 0)
        if not self.child:
            os.waitpid(connector, 0)
            raise AssertionError("the connector failed before it handed its socket on")
        self._commands = os.fdopen(cmd_w, "wb", buffering=0)
        self._replies = os.fdopen(out_r, "rb")

    def wait_connector(self) -> None:
        """Until the connector is gone (reaped: its pid names nothing any more)."""
        os.waitpid(self.connector, 0)

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self._commands.write(json.dumps([op, args]).encode() + b"\n")
        return json.loads(self._replies.readline())

    def close(self) -> None:
        self._commands.close()  # the child exits
        self._replies.close()


def _processes_of(uid: int) -> set[int]:
    out = set()
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                out.add(int(name))
        except OSError:
            continue
    return out


def _images(client: Any, user: Any, work: str) -> str:
    """Images of a small tree of ``user``'s (dumped; the tree itself is gone)."""
    made = as_user(user, lambda: client.spawn(SLEEPER, ENV, work, f"{work}/img-src.log"))
    assert "value" in made, made
    images = f"{work}/cg-images-{secrets.token_hex(3)}"
    dumped = as_user(user, lambda: client.dump(made["value"], images, leave_running=False)
                     .__dict__)
    assert "value" in dumped, dumped
    return images


def test_kernels_join_the_cgroup_of_the_process_that_connected(
        holding, other_account, cgroups, trees) -> None:
    """The connector's cgroup, read when its connection was accepted, is where the kernel
    goes: after the connector exited, and with the socket's holder in another cgroup."""
    from infinijup.helper_client import HelperClient

    helper, _holds = holding
    conn_group, child_group = cgroups
    client = HelperClient(helper.socket_path, timeout=120)
    work = as_user(other_account, client.work_dir)["value"]
    images = _images(client, other_account, work)
    handed = HandedOn(helper.socket_path, other_account, str(conn_group / "cgroup.procs"),
                      hello=True)
    try:
        handed.wait_connector()
        (child_group / "cgroup.procs").write_text(str(handed.child))
        assert _cgroup_of(handed.child) == "/" + child_group.name
        spawned = handed.call("spawn", {"argv": SLEEPER, "env": ENV, "cwd": work,
                                        "log_path": f"{work}/handed.log"})
        assert spawned["ok"], spawned
        root = trees.add(spawned["result"]["pid"])
        restored = handed.call("restore", {"images_dir": images})
        assert restored["ok"], restored
        restored_root = trees.add(restored["result"]["pid"])
        helper_cgroup = _cgroup_of(helper.proc.pid)
        for tree in (root, restored_root):
            (kernel,) = children_of(tree)
            assert _cgroup_of(tree) == _cgroup_of(kernel) == "/" + conn_group.name
            assert _cgroup_of(kernel) != helper_cgroup
        for tree in (root, restored_root):
            assert handed.call("kill", {"pid": tree})["ok"]
    finally:
        handed.close()


def test_a_connector_gone_before_its_connection_was_accepted_starts_nothing(
        holding, other_account, cgroups, trees) -> None:
    """The connector exits before the helper read what its kernels inherit: its cgroup is
    unknown, so ``spawn`` and ``restore`` on that connection are refused (before issue 26 the
    restored kernel went into the helper's cgroup), and nothing of the user's is started."""
    from infinijup.helper_client import HelperClient

    helper, holds = holding
    conn_group, _child_group = cgroups
    client = HelperClient(helper.socket_path, timeout=120)
    work = as_user(other_account, client.work_dir)["value"]
    images = _images(client, other_account, work)
    trees_before = as_user(other_account, client.trees)
    (holds / "connection_accepted").touch()
    handed = HandedOn(helper.socket_path, other_account, str(conn_group / "cgroup.procs"),
                      hello=False)
    try:
        wait_for(lambda: (holds / "connection_accepted.reached").exists(),
                 what="the helper to accept the connection")
        reached = json.loads((holds / "connection_accepted.reached").read_text())
        assert reached["pid"] == handed.connector
        handed.wait_connector()
        (holds / "connection_accepted").unlink()
        before = _processes_of(other_account.pw_uid)
        spawned = handed.call("spawn", {"argv": SLEEPER, "env": ENV, "cwd": work,
                                        "log_path": f"{work}/gone.log"})
        restored = handed.call("restore", {"images_dir": images})
        for result in (spawned, restored):
            assert not result["ok"], result
            assert result["error"]["reason"] == "caller_unknown", result
            assert "had exited before the helper accepted" in result["error"]["message"]
        assert _processes_of(other_account.pw_uid) <= before
        assert as_user(other_account, client.trees) == trees_before
        assert handed.call("hello", {})["ok"]  # the connection itself still serves
    finally:
        handed.close()


def test_a_cgroup_that_cannot_be_joined_fails_the_op(
        holding, other_account, cgroups, trees) -> None:
    """The connector's cgroup is gone by the time of the op: the launcher (spawn) and CRIU
    (restore) cannot join it, the op fails, and nothing is left running (CRIU is stopped
    before it created a task)."""
    from infinijup.helper_client import HelperClient

    helper, _holds = holding
    conn_group, child_group = cgroups
    client = HelperClient(helper.socket_path, timeout=120)
    work = as_user(other_account, client.work_dir)["value"]
    images = _images(client, other_account, work)
    trees_before = as_user(other_account, client.trees)
    handed = HandedOn(helper.socket_path, other_account, str(conn_group / "cgroup.procs"),
                      hello=True)
    try:
        handed.wait_connector()
        (child_group / "cgroup.procs").write_text(str(handed.child))
        conn_group.rmdir()
        before = _processes_of(other_account.pw_uid)
        spawned = handed.call("spawn", {"argv": SLEEPER, "env": ENV, "cwd": work,
                                        "log_path": f"{work}/nojoin.log"})
        assert not spawned["ok"] and spawned["error"]["reason"] == "spawn_failed", spawned
        assert conn_group.name in spawned["error"]["message"], spawned
        restored = handed.call("restore", {"images_dir": images})
        assert not restored["ok"] and restored["error"]["reason"] == "cgroup_failed", restored
        assert conn_group.name in restored["error"]["message"], restored
        assert _processes_of(other_account.pw_uid) <= before
        assert as_user(other_account, client.trees) == trees_before
    finally:
        handed.close()
