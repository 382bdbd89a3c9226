"""Another real user connecting to the socket cannot touch root's kernel or root's images."""

from __future__ import annotations

import ctypes  # here, not in as_user's child: that account may not read this Python's stdlib
import json
import os
import pwd
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helperkit import READER_SCRIPT, Kernel, children_of, needs_root_and_criu, wait_for

pytestmark = needs_root_and_criu


@pytest.fixture(scope="module")
def other_user(other_account) -> pwd.struct_passwd:
    """This run's second real account (helperkit.other_account)."""
    return other_account


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def client_status_alive(client: Any, user: pwd.struct_passwd, pid: int) -> bool:
    return as_user(user, lambda: client.status(pid).alive)["value"]


def as_user(user: pwd.struct_passwd, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child that has become ``user``; return what it returned, or
    {"error": reason} for an Infinijup error it raised."""
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
            except Exception as exc:  # noqa: BLE001 - report it to the parent
                out = {"error": getattr(exc, "reason", type(exc).__name__), "message": str(exc)}
            os.write(write_fd, json.dumps(out, default=repr).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_other_user_cannot_act_on_roots_kernel(helper, client, kernel: Kernel, other_user) -> None:
    from infinijup.helper_client import HelperClient

    other = HelperClient(helper.socket_path, timeout=60)
    hello = as_user(other_user, lambda: other.hello().__dict__)["value"]
    assert hello["uid"] == other_user.pw_uid
    their_work = hello["work_dir"]
    assert os.stat(their_work).st_uid == other_user.pw_uid

    root_images = os.path.join(client.work_dir(), f"perm-images-{kernel.pid}")
    client.dump(kernel.pid, root_images)

    attempts = {
        "dump": lambda: other.dump(kernel.pid, os.path.join(their_work, "stolen")),
        "kill": lambda: other.kill(kernel.pid),
        "restore over": lambda: other.restore(
            os.path.join(their_work, "nothing"), replace_pid=kernel.pid
        ),
        "status": lambda: other.status(kernel.pid),
    }
    for what, attempt in attempts.items():
        result = as_user(other_user, attempt)
        assert result.get("error") == "permission_denied", (what, result)

    # root's images, even copied into their own work dir and given to them, stay root's
    copied = os.path.join(their_work, "copied-images")
    shutil.copytree(root_images, copied)
    for dirpath, _dirs, files in os.walk(copied):
        os.chown(dirpath, other_user.pw_uid, other_user.pw_gid)
        for name in files:
            os.chown(os.path.join(dirpath, name), other_user.pw_uid, other_user.pw_gid)
    result = as_user(other_user, lambda: other.restore(copied))
    assert result.get("error") == "permission_denied", result
    assert "dumped for uid 0" in result["message"]

    # and the credential check behind the seal refuses them too (real images, run directly)
    from helperkit import CRIU, PYCRIU

    from infinijup_helper.criu import Criu, CriuSettings, check_creds
    from infinijup_helper.protocol import RequestError

    criu = Criu(CriuSettings(CRIU, PYCRIU))
    fd = os.open(root_images, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(RequestError) as refused:
            check_creds(criu, fd, other_user.pw_uid, [other_user.pw_gid])
        assert refused.value.reason == "permission_denied"
        assert "runs as uid(s) [0, 0, 0, 0]" in refused.value.message
        assert check_creds(criu, fd, 0, [0]) >= 1
    finally:
        os.close(fd)

    # the kernel is untouched by all of this
    assert client.status(kernel.pid).alive
    kernel.wait_answering()
    client.release(root_images)
    shutil.rmtree(copied)


def test_other_user_sees_no_exit_codes_of_roots_trees(helper, client, trees, other_user) -> None:
    from helperkit import PYTHON, kernel_env

    from infinijup.helper_client import HelperClient

    work = client.work_dir()
    root = trees.add(
        client.spawn(
            [PYTHON, "-c", "raise SystemExit(4)"], kernel_env(), work, os.path.join(work, "e4.log")
        )
    )
    wait_for(lambda: client.status(root).exit_code == 4, what="exit 4")
    other = HelperClient(helper.socket_path, timeout=60)
    assert as_user(other_user, lambda: other.status(root).__dict__)["value"] == {
        "alive": False,
        "exit_code": None,
        "pages": None,  # only a lazily restored tree has them
    }


SYSTEM_PYTHON = "/usr/bin/python3"  # the venv's may live where other users cannot reach
needs_system_python = pytest.mark.skipif(
    not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"{SYSTEM_PYTHON} is missing"
)


class OwnTree:
    """A reader tree (helperkit.READER_SCRIPT) that the other user spawned in their work dir."""

    def __init__(self, helper, trees, user: pwd.struct_passwd) -> None:
        import time

        from infinijup.helper_client import HelperClient

        self.user = user
        self.client = HelperClient(helper.socket_path, timeout=60)
        self.work = self.as_user(lambda: self.client.work_dir())["value"]
        tag = time.monotonic_ns()
        data, script, self.log = (
            os.path.join(self.work, f"{n}-{tag}") for n in ("data", "reader.py", "log")
        )
        Path(data).write_text("".join(f"{i:04d}\n" for i in range(1000)))
        Path(script).write_text(READER_SCRIPT)
        for path in (data, script):
            os.chown(path, user.pw_uid, user.pw_gid)
        env = {"PATH": "/usr/bin:/bin", "HOME": self.work}
        argv = [SYSTEM_PYTHON, script, data]
        spawned = self.as_user(lambda: self.client.spawn(argv, env, self.work, self.log))
        self.root = trees.add(spawned["value"])
        wait_for(lambda: "ready" in self.lines(), what="reader ready")

    def as_user(self, fn: Callable[[], Any]) -> Any:
        return as_user(self.user, fn)

    def lines(self) -> list[str]:
        return Path(self.log).read_text().splitlines() if os.path.exists(self.log) else []

    def poke(self, pid: int, expect: str) -> None:
        """SIGUSR1 through the signal op (as the user); the reader prints its next record."""
        before = len(self.lines())
        assert self.as_user(lambda: self.client.signal(pid, signal.SIGUSR1)) == {"value": None}
        wait_for(lambda: len(self.lines()) > before, what=expect)
        assert self.lines()[before] == expect


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


@needs_system_python
def test_other_user_spawns_signals_and_kills_their_own_tree(helper, trees, other_user) -> None:
    """The normal case: Jupyter as an ordinary user. Their tree's init and kernel run as them;
    the init keeps only the two capabilities CRIU needs of it (CAP_SYS_ADMIN, CAP_SETGID) in a
    PID namespace, and the user still cannot reach into it (no ptrace, no /proc/PID/mem)."""
    tree = OwnTree(helper, trees, other_user)
    (kernel,) = children_of(tree.root)
    uid = str(other_user.pw_uid)
    init, kern = _status(tree.root), _status(kernel)
    assert init["Uid"].split() == [uid] * 4 and kern["Uid"].split() == [uid] * 4
    assert int(kern["CapEff"], 16) == int(kern["CapPrm"], 16) == 0  # the kernel holds nothing
    namespaced = len(init["NSpid"].split()) == 2
    init_caps = int(init["CapEff"], 16)
    assert init_caps == (((1 << 21) | (1 << 6)) if namespaced else 0), hex(init_caps)
    assert int(init["CapAmb"], 16) == 0 and int(kern["CapAmb"], 16) == 0
    if namespaced:
        # the user cannot read the capable init's memory or environment, nor trace it
        for name in ("mem", "environ"):
            denied = tree.as_user(lambda n=name: open(f"/proc/{tree.root}/{n}", "rb").read(1))
            assert denied.get("error") == "PermissionError", (name, denied)
        traced = tree.as_user(lambda: _ptrace_attach(tree.root))
        assert traced == {"value": 1}, traced  # EPERM
    tree.poke(tree.root, "read 0003")
    assert tree.as_user(lambda: tree.client.status(tree.root).alive) == {"value": True}
    assert tree.as_user(lambda: tree.client.kill(tree.root)) == {"value": None}
    assert not os.path.exists(f"/proc/{kernel}")
    status = tree.as_user(lambda: tree.client.status(tree.root).__dict__)["value"]
    assert status == {"alive": False, "exit_code": -9, "pages": None}


def _ptrace_attach(pid: int) -> int:
    """PTRACE_SEIZE ``pid``; 0 on success, else errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(0x4206, pid, 0, 0) == 0:
        return 0
    return ctypes.get_errno()


@needs_system_python
def test_other_user_round_trips_their_own_tree(helper, trees, other_user) -> None:
    """A plain account's own tree: dump, restore in place, dump the restored tree again, and
    restore a branch beside it (a second copy), all through the real helper, here, where the
    helper's root lacks CAP_SYS_RESOURCE: CRIU runs as the user (creds.py)."""
    tree = OwnTree(helper, trees, other_user)
    tree.poke(tree.root, "read 0003")
    images = os.path.join(tree.work, "own-images")
    dumped = tree.as_user(lambda: tree.client.dump(tree.root, images).__dict__)
    assert "value" in dumped, json.dumps(dumped, indent=1)  # a str: pytest shows all of it
    assert os.stat(images).st_uid == other_user.pw_uid
    tree.poke(tree.root, "read 0004")

    restored = tree.as_user(lambda: tree.client.restore(images, replace_pid=tree.root).pid)
    assert "value" in restored, json.dumps(restored, indent=1)
    new_root = trees.add(restored["value"])
    tree.poke(new_root, "read 0004")
    (new_kernel,) = children_of(new_root)
    assert os.stat(f"/proc/{new_kernel}").st_uid == other_user.pw_uid
    assert _status(new_kernel)["Uid"].split() == [str(other_user.pw_uid)] * 4
    assert int(_status(new_kernel)["CapEff"], 16) == 0

    # the restored tree is theirs to dump again, and the snapshot branches beside it
    again = os.path.join(tree.work, "own-images-again")
    redumped = tree.as_user(lambda: tree.client.dump(new_root, again).__dict__)
    assert "value" in redumped, json.dumps(redumped, indent=1)
    branch = tree.as_user(lambda: tree.client.restore(images).pid)
    if "value" in branch:  # beside the original: needs PID namespaces (not on CUDA machines)
        branch_root = trees.add(branch["value"])
        tree.poke(branch_root, "read 0004")
        mine = tree.as_user(lambda: tree.client.trees())["value"]
        assert sorted(mine) == sorted([new_root, branch_root])
        assert tree.as_user(lambda: tree.client.kill(branch_root)) == {"value": None}
    else:
        assert not helper_uses_pid_namespaces(tree), branch

    # Their images are sealed for them. The kernel's private memory is sealed by size only;
    # everything else, the init's memory included, by hash: tampering is refused.
    seal = json.load(open(os.path.join(images, "infinijup-seal.json")))
    assert seal["owner"] == other_user.pw_uid
    by_hash = {n for n, v in seal["files"].items() if v["sha256"] is not None}
    assert "pages-1.img" in by_hash and "files.img" in by_hash
    assert any(n.startswith("pages-") and n not in by_hash for n in seal["files"])
    for victim in ("files.img", "pages-1.img"):
        flip_last_byte(os.path.join(images, victim))
        result = tree.as_user(lambda: tree.client.restore(images, replace_pid=new_root))
        assert result.get("error") == "permission_denied", result
        assert f"{victim} differs" in result["message"]
        flip_last_byte(os.path.join(images, victim))
    planted = os.path.join(images, "pages-1.img")
    os.rename(planted, planted + ".bak")
    os.symlink("/etc/shadow", planted)
    os.lchown(planted, other_user.pw_uid, other_user.pw_gid)
    result = tree.as_user(lambda: tree.client.restore(images))
    assert result.get("error") == "permission_denied" and "pages-1.img" in result["message"]
    os.unlink(planted)
    os.rename(planted + ".bak", planted)

    assert tree.as_user(lambda: tree.client.kill(new_root)) == {"value": None}
    shutil.rmtree(images)
    shutil.rmtree(again)


def helper_uses_pid_namespaces(tree: OwnTree) -> bool:
    return tree.as_user(lambda: tree.client.hello().features["pid_namespace"])["value"]
