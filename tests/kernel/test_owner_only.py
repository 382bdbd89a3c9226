"""Only its owner can reach a kernel (issue 26), tried for real by a second account.

A squatter account tries, in a loop every millisecond, to bind, connect to and read the kernel's
endpoints while the kernel is hibernated and woken, restored in place and resumed into a new
kernel. Endpoints are unix sockets in a directory only the owner can enter (infinijup/
endpoints.py), so each attempt fails, and the victim's cells answer with their state. The kernel
holds no TCP listener at all. Each kernel session has a key of its own, shown nowhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helperkit import SYSTEM_PYTHON, other_account, user_argv  # noqa: F401 - fixture
from kernelkit import Notebook, needs_helper
from test_resume import attach, resume

from infinijup.engine.retarget import endpoint_paths
from infinijup.kernel_key import UnsafeKeyFile, read_private
from infinijup.unix_diag import own_socket_inodes

pytestmark = [needs_helper, pytest.mark.timeout(600)]

# The squatter: binds, connects and lists what it is given, until it is told to stop (SIGTERM),
# at most 100000 rounds; prints how many tries it made and every one that got through.
SQUATTER = r"""
import errno, json, os, signal, socket, sys, time
paths = json.loads(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
tries, through = 0, []
print("ready", flush=True)
for _ in range(100000):
    if stop:
        break
    for p in paths:
        for what in ("bind", "connect"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                if what == "bind":
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
                    s.bind(p)
                    s.listen()
                else:
                    s.connect(p)
                through.append([what, p])
            except OSError:
                pass
            finally:
                s.close()
            tries += 1
        try:
            os.listdir(os.path.dirname(p))
            through.append(["list", p])
        except OSError:
            pass
    time.sleep(0.001)
print(json.dumps({"tries": tries, "through": through}), flush=True)
"""


def manager(jp_serverapp):
    return jp_serverapp.web_app.settings["infinijup_manager"]


def connection(jp_serverapp, kernel_id: str) -> dict:
    return jp_serverapp.kernel_manager.get_kernel(kernel_id).get_connection_info()


def tree_pids(root: int) -> list[int]:
    pids, queue = [], [root]
    while queue:
        pid = queue.pop()
        pids.append(pid)
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                queue.extend(int(p) for p in f.read().split())
    return pids


def tcp_listeners_of(root: int) -> list[str]:
    """Listening TCP sockets held by any process of the tree at ``root``."""
    inodes = set()
    for pid in tree_pids(root):
        inodes |= {str(i) for i in own_socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    found.append(fields[1])
    return found


class Squatter:
    def __init__(self, user, paths: list[str]) -> None:
        self.proc = subprocess.Popen(
            user_argv(user, [SYSTEM_PYTHON, "-c", SQUATTER, json.dumps(paths)]),
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def result(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=120)
        return json.loads(out.strip().splitlines()[-1])


async def test_another_account_reaches_no_endpoint_through_hibernation_restore_and_resume(
        notebook: Notebook, jp_serverapp, other_account):  # noqa: F811 - fixture
    nb = notebook
    await nb.execute("x = 41\nimport os, multiprocessing")
    info = connection(jp_serverapp, nb.kernel_id)
    assert info["transport"] == "ipc", info
    kernel_dir = Path(info["ip"]).parent
    st = kernel_dir.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)
    root = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
    assert tcp_listeners_of(root) == []  # no port at all, not even ipykernel's own pipe
    paths = sorted(endpoint_paths(info).values())
    squatter = Squatter(other_account, paths)
    try:
        snap = await nb.snapshot(message="before")
        await nb.execute("x += 1")

        r = await nb.post("hibernate", {"kernel_id": nb.kernel_id})
        assert r.code == 200 and json.loads(r.body)["state"] == "hibernated", r.body
        assert await nb.value("x") == 42  # the next cell woke it, with its state

        await nb.restore(snap["commit"])  # in place: the kernel is killed, CRIU binds again
        assert await nb.value("x") == 41

        code, body = await resume(nb, snap["commit"], new_notebook=True)
        assert code == 200, body
        copy = await attach(Notebook(nb.fetch, nb.ws_fetch, body["path"]), body["kernel_id"])
        try:
            assert await copy.value("x") == 41
            # output of a forked subprocess comes back through the kernel's private pipe
            out = await copy.execute(
                "p = multiprocessing.get_context('fork').Process(target=print, args=('forked',))"
                "\np.start(); p.join()")
            assert "forked" in out["stdout"], out
            copy_info = connection(jp_serverapp, copy.kernel_id)
            assert Path(copy_info["ip"]).parent != kernel_dir
            copy_root = jp_serverapp.kernel_manager.get_kernel(
                copy.kernel_id).provisioner.root_pid
            assert tcp_listeners_of(copy_root) == []
        finally:
            await copy.close()
        assert await nb.value("x") == 41  # the original kept its endpoints
    finally:
        result = squatter.result()
    assert result["tries"] > 100, result
    assert result["through"] == [], result


async def test_kernels_hold_keys_of_their_own_that_nothing_shows(
        notebook: Notebook, jp_serverapp, caplog, tmp_path):
    nb = notebook
    await nb.execute("x = 1")
    other = await Notebook(nb.fetch, nb.ws_fetch, "other.ipynb").start("infinijup")
    try:
        keys = {jp_serverapp.kernel_manager.get_kernel(k).session.key
                for k in (nb.kernel_id, other.kernel_id)}
        assert len(keys) == 2
        snap = await nb.snapshot(message="keyed")
        key = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).session.key.decode()
        shown = subprocess.run(
            [str(Path(sys.executable).with_name("infinijup")), "store", "show", snap["commit"]],
            capture_output=True, text=True, env={**os.environ}, check=True).stdout
        assert "connection" in shown and key not in shown, shown
        status = await nb.fetch("infinijup", "status", params={"kernel_id": nb.kernel_id})
        history = await nb.history()
        assert key not in status.body.decode() and key not in json.dumps(history)
        assert key not in caplog.text
    finally:
        await other.close()


def test_key_files_others_could_touch_are_refused(tmp_path, other_account):  # noqa: F811
    good = tmp_path / "good.json"
    good.write_text('{"key": "k"}')
    good.chmod(0o600)
    tmp_path.chmod(0o700)
    assert read_private(str(good)) == b'{"key": "k"}'
    loose = tmp_path / "loose.json"
    loose.write_text("{}")
    loose.chmod(0o644)
    with pytest.raises(UnsafeKeyFile, match="chmod 600"):
        read_private(str(loose))
    theirs = tmp_path / "theirs.json"
    theirs.write_text("{}")
    theirs.chmod(0o600)
    os.chown(theirs, other_account.pw_uid, other_account.pw_gid)
    with pytest.raises(UnsafeKeyFile, match="belongs to uid"):
        read_private(str(theirs))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    inside = shared / "key.json"
    inside.write_text("{}")
    inside.chmod(0o600)
    with pytest.raises(UnsafeKeyFile, match="other accounts"):
        read_private(str(inside))
    link = tmp_path / "link.json"
    link.symlink_to(good)
    with pytest.raises(OSError):
        read_private(str(link))
