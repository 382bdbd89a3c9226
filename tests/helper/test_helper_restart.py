"""Killing the helper (SIGKILL) leaves its kernels running; a new helper can dump and kill them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helperkit import HelperDaemon, as_user, make_base, needs_root_and_criu, start_kernel

pytestmark = needs_root_and_criu


def test_kernel_survives_helper_sigkill_and_new_helper_can_dump_it(trees) -> None:
    from infinijup.helper_client import HelperClient

    first = HelperDaemon(make_base())
    first.start()
    second = HelperDaemon(first.base)
    kernel = None
    try:
        client = HelperClient(first.socket_path, timeout=60)
        kernel = start_kernel(client, trees, name="survivor")
        kernel.execute("y = 41")
        first.stop(signal.SIGKILL)

        assert os.path.exists(f"/proc/{kernel.pid}")
        kernel.wait_answering()
        assert kernel.evaluate(y="y + 1")["y"] == "42"

        second.start()  # same socket, same work dir: a stale socket file is replaced
        client = HelperClient(second.socket_path, timeout=60)
        assert client.status(kernel.pid).alive
        images = os.path.join(client.work_dir(), "after-restart")
        client.dump(kernel.pid, images)
        restored = trees.add(client.restore(images, replace_pid=kernel.pid).pid)
        kernel.wait_answering()
        assert kernel.evaluate(y="y")["y"] == "41"
        client.kill(restored)
        assert not os.path.exists(f"/proc/{restored}")
    finally:
        if kernel is not None:
            kernel.close()
        first.stop(signal.SIGKILL)
        second.stop()
        shutil.rmtree(first.base, ignore_errors=True)


@pytest.mark.parametrize("written", ["another boot id", "no boot id, before this boot"])
def test_a_registry_of_another_boot_is_forgotten(other_account, written) -> None:
    """Issue 26: the registry names trees by pid and start time, which name one process for
    one boot only. A registry file of another boot (a socket dir that outlived a reboot) is
    forgotten: none of its trees is adopted, and the process its pid names now, whoever's, is
    not the user's to dump, signal or kill. The same file written during this boot is
    adopted (the control)."""
    from infinijup.helper_client import HelperClient
    from infinijup_helper.registry import start_time

    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    boot_time = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
    base = make_base()
    run = base / "run"
    run.mkdir(mode=0o755)
    registry = run / "helper.sock.trees.json"
    victim = subprocess.Popen(["sleep", "600"])  # root's; the registry names its pid
    entry = {"pid": victim.pid, "start": start_time(victim.pid), "owner": other_account.pw_uid,
             "namespace": False}

    def write(boot: str | None, mtime: float | None = None) -> None:
        recorded: dict = {"v": 1, "trees": [entry]}
        if boot is not None:
            recorded["boot_id"] = boot
        registry.write_text(json.dumps(recorded))
        os.chmod(registry, 0o644)
        if mtime is not None:
            os.utime(registry, (mtime, mtime))

    helper = HelperDaemon(base)
    try:
        write(boot_id)  # the control: this boot's file is adopted
        helper.start()
        client = HelperClient(helper.socket_path, timeout=60)
        assert as_user(other_account, client.trees) == {"value": [victim.pid]}
        helper.stop()

        if written == "another boot id":
            write("00000000-0000-4000-8000-000000000000")
        else:
            write(None, mtime=boot_time - 3600)
        helper.start()
        assert as_user(other_account, client.trees) == {"value": []}
        for attempt in (lambda: client.kill(victim.pid),
                        lambda: client.signal(victim.pid, signal.SIGTERM),
                        lambda: client.dump(victim.pid, f"{client.work_dir()}/stolen")):
            result = as_user(other_account, attempt)
            assert result.get("error") == "no_such_process", result
        assert victim.poll() is None  # untouched
        rewritten = json.loads(registry.read_text())
        assert rewritten["trees"] == [] and rewritten["boot_id"] == boot_id, rewritten
        assert "none adopted" in helper.log()
    finally:
        helper.stop()
        victim.kill()
        victim.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_a_leftover_page_daemon_socket_is_told_to_give_up_and_no_link_is_followed(tmp_path) -> None:
    """A restarted helper connects to the page daemon socket of each staging dir left over
    and closes at once (a daemon still waiting for its restore reads nothing and exits:
    tests/reliability's ``test_helper_and_criu_killed_at_criu_start``). The name is opened
    without following a link, so a link put there to some other socket is not connected to."""
    import socket

    from infinijup_helper.lazy_pages import SOCKET, end_waiting_daemon

    staging = tmp_path / "staging"
    staging.mkdir()
    daemon = socket.socket(socket.AF_UNIX)
    daemon.bind(str(staging / SOCKET))
    daemon.listen(1)
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert end_waiting_daemon(fd)
        conn, _ = daemon.accept()
        assert conn.recv(16) == b""  # closed at once: the daemon's read of the restore fails
        conn.close()
        os.unlink(staging / SOCKET)
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(tmp_path / "other.sock"))
        other.listen(1)
        os.symlink(tmp_path / "other.sock", staging / SOCKET)
        assert not end_waiting_daemon(fd)
        other.setblocking(False)
        with pytest.raises(BlockingIOError):
            other.accept()  # nobody connected to it
    finally:
        os.close(fd)
