"""A plain Python process tree (a parent with a child and a file read half-way) round-trips,
``kill`` takes the whole tree, and ``status`` reports exits."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helperkit import (
    PYTHON,
    READER_SCRIPT,
    children_of,
    kernel_env,
    needs_root_and_criu,
    read_nspid,
    wait_for,
)

pytestmark = needs_root_and_criu


def _log_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []


def _poke(root: int, log: str, expect: str) -> None:
    """SIGUSR1 to the tree root (nsinit forwards it) and wait for the reader's answer."""
    before = len(_log_lines(log))
    os.kill(root, signal.SIGUSR1)
    wait_for(lambda: len(_log_lines(log)) > before, what=f"{expect!r} in {log}")
    assert _log_lines(log)[before] == expect


def _spawn_reader(client, trees, tag: str) -> tuple[int, str]:
    work = client.work_dir()
    data = os.path.join(work, f"records-{tag}.txt")
    Path(data).write_text("".join(f"{i:04d}\n" for i in range(1000)))
    script = os.path.join(work, f"reader-{tag}.py")
    Path(script).write_text(READER_SCRIPT)
    log = os.path.join(work, f"reader-{tag}.log")
    root = trees.add(client.spawn([PYTHON, script, data], kernel_env(), work, log))
    wait_for(lambda: "ready" in _log_lines(log), what="reader ready")
    return root, log


def test_tree_with_child_and_open_file_round_trips(client, trees) -> None:
    root, log = _spawn_reader(client, trees, f"rt{time.monotonic_ns()}")
    _poke(root, log, "read 0003")

    images = os.path.join(client.work_dir(), f"tree-images-{root}")
    client.dump(root, images)
    _poke(root, log, "read 0004")  # the log grows after the dump: restore must not mind
    _poke(root, log, "read 0005")

    restored = client.restore(images, replace_pid=root).pid
    trees.add(restored)
    _poke(restored, log, "read 0004")  # the file offset is the dumped one

    (reader,) = children_of(restored)
    (sleeper,) = children_of(reader)
    assert read_nspid(restored)[-1] == 1
    assert read_nspid(reader)[-1] == 2
    assert read_nspid(sleeper)[-1] == 3

    client.kill(restored)
    for pid in (restored, reader, sleeper):
        assert not os.path.exists(f"/proc/{pid}"), f"{pid} survived kill"
    client.release(images)


def test_kill_takes_the_whole_tree_and_status_reports_it(client, trees) -> None:
    root, log = _spawn_reader(client, trees, f"kill{time.monotonic_ns()}")
    (reader,) = children_of(root)
    (sleeper,) = children_of(reader)
    assert client.status(root).alive
    client.kill(root)
    for pid in (root, reader, sleeper):
        assert not os.path.exists(f"/proc/{pid}"), f"{pid} survived kill"
    status = client.status(root)
    assert not status.alive and status.exit_code == -signal.SIGKILL


def test_leave_running_false_stops_the_tree(client, trees) -> None:
    root, log = _spawn_reader(client, trees, f"stop{time.monotonic_ns()}")
    images = os.path.join(client.work_dir(), f"stopped-images-{root}")
    client.dump(root, images, leave_running=False)
    wait_for(lambda: not client.status(root).alive, what="tree to stop after dump")
    restored = trees.add(client.restore(images).pid)
    _poke(restored, log, "read 0003")
    client.kill(restored)
    client.release(images)


def test_status_reports_exit_code_of_a_tree_that_exits(client, trees) -> None:
    work = client.work_dir()
    root = trees.add(
        client.spawn(
            [PYTHON, "-c", "import sys; sys.exit(3)"],
            kernel_env(),
            work,
            os.path.join(work, "exit3.log"),
        )
    )
    wait_for(lambda: not client.status(root).alive, what="tree to exit")
    wait_for(lambda: client.status(root).exit_code is not None, what="exit code")
    assert client.status(root).exit_code == 3


def test_status_of_unknown_pid(client) -> None:
    status = client.status(4_000_000)
    assert not status.alive and status.exit_code is None


def test_spawn_of_missing_program_fails_clearly(client) -> None:
    from infinijup.errors import HelperError

    work = client.work_dir()
    with pytest.raises(HelperError) as failed:
        client.spawn(["/nonexistent/program"], kernel_env(), work, os.path.join(work, "m.log"))
    assert failed.value.reason == "spawn_failed"
    assert "exec /nonexistent/program" in str(failed.value)


def test_signal_op_reaches_the_kernel(client, trees) -> None:
    root, log = _spawn_reader(client, trees, f"sig{time.monotonic_ns()}")
    before = len(_log_lines(log))
    client.signal(root, signal.SIGUSR1)
    wait_for(lambda: len(_log_lines(log)) > before, what="the reader to answer")
    assert _log_lines(log)[before] == "read 0003"
    client.kill(root)


def test_spawn_into_missing_cwd_fails_clearly(client) -> None:
    from infinijup.errors import HelperError

    work = client.work_dir()
    try:
        client.spawn(
            [PYTHON, "-c", "pass"], kernel_env(), "/nonexistent-dir", os.path.join(work, "cwd.log")
        )
    except HelperError as exc:
        assert exc.reason == "spawn_failed" and "chdir" in str(exc)
    else:
        raise AssertionError("spawn into a missing cwd succeeded")


def test_concurrent_ops_on_one_tree_are_serialized_and_others_proceed(client, trees) -> None:
    import threading

    work = client.work_dir()
    roots = [
        trees.add(
            client.spawn(
                [PYTHON, "-c", "import time; time.sleep(3600)"],
                kernel_env(),
                work,
                os.path.join(work, f"c{i}.log"),
            )
        )
        for i in range(2)
    ]
    targets = [(roots[0], "a"), (roots[0], "b"), (roots[1], "c")]
    errors: list[BaseException] = []

    def dump(pid: int, tag: str) -> None:
        try:
            client.dump(pid, os.path.join(work, f"concurrent-{pid}-{tag}"))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=dump, args=t) for t in targets]
    for t in threads:
        t.start()
    assert client.hello().version == 1  # the helper still answers while dumps run
    for t in threads:
        t.join(60)
    assert errors == []
    for pid, tag in targets:
        assert os.path.isdir(os.path.join(work, f"concurrent-{pid}-{tag}"))
        client.release(os.path.join(work, f"concurrent-{pid}-{tag}"))
    for pid in roots:
        client.kill(pid)


# A process holding a perf event (an fd type CRIU cannot dump): a software clock of its own.
PERF_HOLDER = r"""
import ctypes, struct, time
attr = bytearray(128)
struct.pack_into("=IIQ", attr, 0, 1, 128, 0)  # PERF_TYPE_SOFTWARE, size, PERF_COUNT_SW_CPU_CLOCK
fd = ctypes.CDLL(None, use_errno=True).syscall(298, ctypes.c_char_p(bytes(attr)), 0, -1, -1, 0)
print("held" if fd >= 0 else f"no perf event: errno {ctypes.get_errno()}", flush=True)
time.sleep(3600)
"""


def test_failed_dump_leaves_the_tree_running_and_no_images(client, trees) -> None:
    """A perf event is something CRIU refuses to dump. (A connection to a unix socket outside
    the tree no longer is: kernels' ZMQ connections are such, see unix_peers.py.)"""
    from infinijup.errors import HelperError

    work = client.work_dir()
    log = os.path.join(work, f"perf-{time.monotonic_ns()}.log")
    root = trees.add(client.spawn([PYTHON, "-c", PERF_HOLDER], kernel_env(), work, log))
    wait_for(lambda: os.path.exists(log) and open(log).read().strip(), what="the holder's word")
    said = open(log).read().strip()
    if said != "held":
        client.kill(root)
        pytest.skip(f"this machine gives no perf event to the test ({said})")
    images = os.path.join(work, f"failed-{root}")
    with pytest.raises(HelperError) as failed:
        client.dump(root, images)
    assert failed.value.reason == "criu_failed"
    assert "Error" in str(failed.value)  # the tail of CRIU's log
    assert not os.path.exists(images)
    assert client.status(root).alive
    (holder,) = children_of(root)
    assert read_proc_state(holder) in ("S", "R")  # resumed, not left frozen
    client.kill(root)


def test_a_connection_to_a_unix_socket_outside_the_tree_comes_back_closed(client, trees,
                                                                          tmp_path) -> None:
    """The server's ZMQ connections to a kernel are unix stream sockets to a peer outside the
    tree: the dump takes them, and the restored tree finds them closed (its peer is gone)."""
    import socket as socketlib

    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    outside = str(tmp_path / "outside.sock")
    listener.bind(outside)
    listener.listen(1)
    work = client.work_dir()
    code = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX); "
        f"s.connect({outside!r}); print('connected', flush=True); "
        "print('read', repr(s.recv(10)), flush=True); sys.stdout.flush(); "
        "__import__('time').sleep(3600)"
    )
    log = os.path.join(work, f"extsock-{time.monotonic_ns()}.log")
    root = trees.add(client.spawn([PYTHON, "-c", code], kernel_env(), work, log))
    peer, _ = listener.accept()
    images = os.path.join(work, f"extsock-{root}")
    try:
        client.dump(root, images, leave_running=False)
        restored = trees.add(client.restore(images).pid)
        wait_for(lambda: "read b''" in open(log).read(), what="the restored end to read EOF")
    finally:
        peer.close()
        listener.close()
    client.kill(restored)


def read_proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("State:"):
                return line.split()[1]
    return "?"
