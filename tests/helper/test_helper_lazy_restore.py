"""Lazy restore through the helper: a real ipykernel answers before its memory is back, every
page arrives intact, and a page daemon that dies mid-stream ends the kernel (no hang, no
zeroed memory) and leaves the images for a second restore."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helperkit import HelperDaemon, Kernel, needs_root_and_criu, own_helper

pytestmark = needs_root_and_criu

MIB = 384  # the kernel's random bytes: a few hundred pages' worth of streaming at least
FILL = (f"import os, hashlib\nblob = bytearray(os.urandom({MIB} << 20))\n"
        "digest = hashlib.blake2b(blob).hexdigest()")
CHECK = "hashlib.blake2b(blob).hexdigest() == digest"


@pytest.fixture(scope="module")
def helper() -> Iterator[HelperDaemon]:
    """This module's own helper, with hold points (infinijup_helper/holds.py)."""
    with own_helper(holds=True) as daemon:
        yield daemon


def _wait(predicate, what: str, timeout: float = 120.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout  # hang guard only
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def _dump(client, kernel: Kernel) -> str:  # noqa: ANN001
    kernel.execute(FILL, timeout=120)
    images = os.path.join(client.work_dir(), f"lazy-{kernel.pid}")
    client.dump(kernel.pid, images)
    kernel.execute("blob[:8] = b'changed!'")  # the live kernel moves on; the images do not
    return images


def test_lazy_restore_answers_then_every_page_arrives(client, kernel: Kernel, trees,
                                                      helper) -> None:
    images = _dump(client, kernel)
    old = kernel.pid
    restored = client.restore(images, replace_pid=old, lazy=True)
    trees.add(restored.pid)
    # the replaced tree was killed and exited beside the restore; it is reaped after it, not
    # left a zombie (checkpoint.KillReplaced; with no PID namespace, the restored tree has its
    # pid back, and the old one was reaped before)
    if restored.pid != old:
        _wait(lambda: not os.path.exists(f"/proc/{old}"), "the replaced tree to be reaped")
    # streaming, or already resident on a machine that starved the helper's answer (the
    # kernel running before its memory was back is shown by the tests below, held)
    assert restored.pages is not None and restored.pages["state"] in ("streaming", "resident")

    kernel.wait_answering(timeout=60)
    done = _wait(lambda: (s := client.status(restored.pid).pages)["state"] != "streaming" and s,
                 "the page daemon to finish")
    assert done["state"] == "resident", done
    assert done["resident_s"] > 0
    assert kernel.evaluate(ok=CHECK, head="bytes(blob[:8]) != b'changed!'") == {
        "ok": "True", "head": "True"}
    assert not os.path.exists(f"/proc/{done['daemon_pid']}")
    assert _uffds_held(helper) == 0

    # the staging dir went with the daemon; the images are the caller's, untouched
    client.release(images)


def test_the_page_daemon_dying_ends_the_kernel_and_keeps_the_images(
        client, kernel: Kernel, trees, helper) -> None:
    images = _dump(client, kernel)
    # the kernel runs into a page the stopped daemon has not served (the cell reads every
    # byte) and waits there
    restored, daemon = _restore_with_daemon_stopped(client, helper, images, trees, kernel)
    assert client.status(restored.pid).pages["state"] == "streaming"
    # the helper's own references keep the kernel's faults waiting once the daemon is gone
    # (the last reference closed, the kernel would get zero pages instead: lazy_pages.py)
    # (nsinit's may be gone already: the daemon lets go of a process whose memory is all
    # back, and may have streamed nsinit's few pages before it was stopped)
    assert _uffds_held(helper) >= 1 and _faults_waiting(helper) > 0
    os.kill(daemon, signal.SIGKILL)
    status = _wait(lambda: (s := client.status(restored.pid)).pages["state"] == "failed" and s,
                   "the helper to see the daemon gone")
    assert "page daemon ended" in status.pages["error"]
    _wait(lambda: not client.status(restored.pid).alive, "the kernel to be ended")
    # killed by the helper while it waited in a fault (SIGKILL, -9), not run on with zero
    # pages (it would crash or compute a wrong digest); nothing of the stream is left
    assert client.status(restored.pid).exit_code == -9
    assert _uffds_held(helper) == 0

    # the snapshot is intact: restored again (whole this time), every byte is right
    again = client.restore(images)
    trees.add(again.pid)
    kernel.wait_answering(timeout=60)
    assert kernel.evaluate(ok=CHECK) == {"ok": "True"}
    client.release(images)


def _restore_with_daemon_stopped(client, helper, images: str, trees, kernel: Kernel):  # noqa: ANN001, ANN202
    """A lazy restore whose page daemon is stopped mid-stream: the kernel runs, a cell
    reading every byte is sent, and it waits in a fault (seen in the uffds' counts).

    The daemon is stopped at CRIU's post-resume, streaming: stopped earlier, it sits in an
    epoll_wait that a stop and continue end with EINTR, and CRIU's daemon exits on that. So
    that it cannot stream everything and exit before the stop (a loaded machine did that
    once), it runs on 1 ms of CPU a second from the moment the helper took its userfaultfds
    (before it served a page) until it is stopped."""
    holds = Path(helper.holds_dir)
    taken, resumed = holds / "lazy_pages_held", holds / "criu_restore_post-resume"
    for point in (taken, resumed):
        Path(f"{point}.reached").unlink(missing_ok=True)
        point.touch()
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        r=client.restore(images, replace_pid=kernel.pid, lazy=True)))
    worker.start()
    _wait(Path(f"{taken}.reached").exists, "the daemon's userfaultfds taken")
    daemon = json.loads(Path(f"{taken}.reached").read_text())["daemon_pid"]
    assert _daemon_of(helper) == daemon
    with _cpu_starved(daemon):
        taken.unlink()
        _wait(Path(f"{resumed}.reached").exists, "post-resume")
        os.kill(daemon, signal.SIGSTOP)
    resumed.unlink()
    for point in (taken, resumed):
        Path(f"{point}.reached").unlink()
    worker.join(timeout=120)
    restored = result["r"]
    trees.add(restored.pid)
    kernel.kc.execute(CHECK, store_history=False)
    _wait(lambda: _faults_waiting(helper) > 0, "the kernel to wait in a page fault")
    return restored, daemon


@contextlib.contextmanager
def _cpu_starved(pid: int) -> Iterator[None]:
    """``pid`` in a cgroup of its own allowed 1 ms of CPU a second (v1's cpu controller or
    v2's cpu.max), back where it was afterwards."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        before = next(line.split(":", 2)[2] for line in
                      Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                      if "cpu" in line.split(":", 2)[1].split(","))
        home, group = v1 / before.lstrip("/"), v1 / f"ijtest-starved-{pid}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("1000000")
        (group / "cpu.cfs_quota_us").write_text("1000")
    else:
        root = Path("/sys/fs/cgroup")
        assert "cpu" in (root / "cgroup.controllers").read_text().split(), \
            "no cgroup cpu controller to slow the page daemon with"
        before = next(line.split(":", 2)[2] for line in
                      Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                      if line.startswith("0::"))
        home, group = root / before.lstrip("/"), root / f"ijtest-starved-{pid}"
        (root / "cgroup.subtree_control").write_text("+cpu")
        group.mkdir()
        (group / "cpu.max").write_text("1000 1000000")
    try:
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        (home / "cgroup.procs").write_text(str(pid))
        group.rmdir()


def test_a_renewal_after_the_daemon_died_keeps_every_fault_waiting(
        client, kernel: Kernel, trees, helper) -> None:
    """The watcher's renewal of its uffd references runs after the daemon died (held there
    while the daemon is killed): it must keep every reference, so the kernel's fault still
    waits until the helper ends the tree, instead of reading zero pages."""
    images = _dump(client, kernel)
    restored, daemon = _restore_with_daemon_stopped(client, helper, images, trees, kernel)
    holds = Path(helper.holds_dir)
    renew, ended = holds / "lazy_pages_renew", holds / "lazy_pages_ended"
    renew.touch()
    ended.touch()
    _wait(lambda: (holds / "lazy_pages_renew.reached").exists(), "a renewal")
    os.kill(daemon, signal.SIGKILL)
    _wait(lambda: _state(daemon) in ("Z", None), "the daemon to be dead")  # not reaped yet
    renew.unlink()  # the renewal scans a dead daemon
    _wait(lambda: (holds / "lazy_pages_ended.reached").exists(), "the watcher to see it")
    try:
        # the tree not yet ended: its fault still waits, on the helper's references alone
        assert _uffds_held(helper) >= 1  # the kernel's (nsinit's may be done already)
        assert _faults_waiting(helper) > 0
        assert client.status(restored.pid).alive
    finally:
        ended.unlink()
        for reached in holds.glob("*.reached"):
            reached.unlink()
    status = _wait(lambda: (s := client.status(restored.pid)).pages["state"] == "failed" and s,
                   "the helper to record the failure")
    assert "page daemon ended" in status.pages["error"]
    _wait(lambda: not client.status(restored.pid).alive, "the kernel to be ended")
    assert client.status(restored.pid).exit_code == -9
    assert _uffds_held(helper) == 0

    again = client.restore(images)
    trees.add(again.pid)
    kernel.wait_answering(timeout=60)
    assert kernel.evaluate(ok=CHECK) == {"ok": "True"}
    client.release(images)


def _daemon_dir(daemon: int) -> str:
    """The staging dir the page daemon serves from (its -D /proc/self/fd/N)."""
    argv = Path(f"/proc/{daemon}/cmdline").read_bytes().split(b"\0")
    fd = argv[argv.index(b"-D") + 1].decode().rsplit("/", 1)[1]
    return os.readlink(f"/proc/{daemon}/fd/{fd}")


def test_page_files_removed_mid_stream_are_still_served(client, kernel: Kernel, trees,
                                                         helper) -> None:
    """The page files unlinked (images dir and staging dir) while the daemon is stopped
    mid-stream: it read them through descriptors it opened when it took each process, so
    every page still arrives."""
    images = _dump(client, kernel)
    restored, daemon = _restore_with_daemon_stopped(client, helper, images, trees, kernel)
    staging = _daemon_dir(daemon)
    gone = [d / n for d in (Path(images), Path(staging)) for n in os.listdir(d)
            if n.startswith("pages-")]
    assert len(gone) >= 4  # nsinit's and the kernel's, in both dirs
    for path in gone:
        path.unlink()
    os.kill(daemon, signal.SIGCONT)
    done = _wait(lambda: (s := client.status(restored.pid).pages)["state"] != "streaming" and s,
                 "the page daemon to finish")
    assert done["state"] == "resident", done
    kernel.wait_answering(timeout=60)
    assert kernel.evaluate(ok=CHECK) == {"ok": "True"}
    assert _uffds_held(helper) == 0 and not os.path.exists(f"/proc/{daemon}")
    client.release(images)


def test_page_files_truncated_mid_stream_end_the_kernel_with_the_reason(
        client, kernel: Kernel, trees, helper, tmp_path) -> None:
    """The page files cut to nothing while the daemon is stopped mid-stream (the staging
    dir's links are the images' own inodes): the daemon's reads fail, the kernel, waiting in
    a fault, is ended (not left hanging, not run on zero pages), the failure says why,
    nothing of the stream is left, and the images, put back, restore again."""
    images = _dump(client, kernel)
    saved = tmp_path / "pages"
    saved.mkdir()
    pages = [n for n in os.listdir(images) if n.startswith("pages-")]
    for name in pages:
        shutil.copy2(Path(images) / name, saved / name)
    restored, daemon = _restore_with_daemon_stopped(client, helper, images, trees, kernel)
    for name in pages:
        os.truncate(Path(images) / name, 0)
    os.kill(daemon, signal.SIGCONT)
    status = _wait(lambda: (s := client.status(restored.pid)).pages["state"] != "streaming"
                   and s, "the page daemon to end")
    assert status.pages["state"] == "failed", status
    assert "page daemon ended" in status.pages["error"]
    assert "failed reading pages" in status.pages["error"]  # CRIU's own account, kept
    _wait(lambda: not client.status(restored.pid).alive, "the kernel to be ended")
    assert client.status(restored.pid).exit_code == -9
    assert _uffds_held(helper) == 0 and not os.path.exists(f"/proc/{daemon}")

    for name in pages:
        os.unlink(Path(images) / name)
        shutil.copy2(saved / name, Path(images) / name)
    again = client.restore(images, lazy=True)
    trees.add(again.pid)
    kernel.wait_answering(timeout=60)
    assert kernel.evaluate(ok=CHECK) == {"ok": "True"}
    _wait(lambda: client.status(again.pid).pages["state"] == "resident", "the second stream")
    client.release(images)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _faults_waiting(helper) -> int:  # noqa: ANN001
    """Faults waiting on the userfaultfds the helper holds (their fdinfo's total: read by
    the daemon or not, unanswered)."""
    base = f"/proc/{helper.proc.pid}"
    waiting = 0
    for name in os.listdir(f"{base}/fd"):
        try:
            if os.readlink(f"{base}/fd/{name}") != "anon_inode:[userfaultfd]":
                continue
            with open(f"{base}/fdinfo/{name}") as f:
                for line in f:
                    if line.startswith("total:"):
                        waiting += int(line.split()[1])
        except OSError:
            continue
    return waiting


def _daemon_of(helper) -> int:  # noqa: ANN001
    """The running lazy-pages daemon (the helper's child; one restore at a time here)."""
    me = helper.proc.pid
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and b"lazy-pages" in cmd:
            return int(entry)
    raise AssertionError(f"no lazy-pages daemon under the helper {me}")


def _uffds_held(helper) -> int:  # noqa: ANN001
    fds = f"/proc/{helper.proc.pid}/fd"
    count = 0
    for name in os.listdir(fds):
        try:
            count += os.readlink(f"{fds}/{name}") == "anon_inode:[userfaultfd]"
        except OSError:
            continue
    return count


HOLDER = """
import hashlib, os, signal, sys, time
blob = bytearray(os.urandom(64 << 20))
out = sys.argv[1]
def write(name):
    with open(name + ".tmp", "w") as f:
        f.write(hashlib.blake2b(blob).hexdigest())
    os.rename(name + ".tmp", name)
write(out)
signal.signal(signal.SIGUSR1, lambda *_: write(out + ".again"))
while True:
    time.sleep(0.05)
"""


def test_a_second_account_asking_for_lazy_gets_a_whole_restore_and_why(
        client, other_account, trees) -> None:
    """CRIU runs as the caller in its unprivileged mode, which (CRIU 4.2) opens no
    userfaultfd: the other account's lazy restore comes back whole, saying so, every byte
    right."""
    from helperkit import SYSTEM_PYTHON, as_user

    work = as_user(other_account, client.work_dir)["value"]
    digest = f"{work}/digest"
    env = {"PATH": "/usr/bin:/bin"}
    made = as_user(other_account, lambda: client.spawn(
        [SYSTEM_PYTHON, "-c", HOLDER, digest], env, work, f"{work}/holder.log"))
    assert "value" in made, made
    _wait(lambda: os.path.exists(digest), "the holder's digest")
    images = f"{work}/lazy-images"
    dumped = as_user(other_account, lambda: client.dump(made["value"], images,
                                                         leave_running=False).__dict__)
    assert "value" in dumped, dumped
    restored = as_user(other_account, lambda: client.restore(images, lazy=True).__dict__)
    assert "value" in restored, restored
    pid = trees.add(restored["value"]["pid"])
    assert restored["value"]["pages"] is None
    assert "unprivileged mode" in restored["value"]["whole_why"]
    sent = as_user(other_account, lambda: client.signal(pid, signal.SIGUSR1))
    assert "value" in sent, sent
    _wait(lambda: os.path.exists(digest + ".again"), "the digest after the restore")
    assert Path(digest + ".again").read_text() == Path(digest).read_text()
    as_user(other_account, lambda: client.kill(pid))


def test_a_kernel_that_maps_the_cuda_driver_is_restored_whole_and_says_why(
        client, kernel: Kernel, trees, tmp_path) -> None:
    """Whether a restore can be lazy is decided by the images, not the machine: a kernel
    that maps the CUDA driver (here a stand-in file of that name: this machine has none) comes
    back whole, saying why; one that does not is lazy (the tests above), on a GPU host too."""
    driver = tmp_path / "libcuda.so.1"
    driver.write_bytes(b"\x7fELF" + bytes(8188))
    kernel.execute(f"import mmap\ncuda_file = open({str(driver)!r}, 'rb')\n"
                   "cuda_map = mmap.mmap(cuda_file.fileno(), 8192, prot=mmap.PROT_READ)")
    images = _dump(client, kernel)
    restored = client.restore(images, replace_pid=kernel.pid, lazy=True)
    trees.add(restored.pid)
    assert restored.pages is None
    assert "GPU" in (restored.whole_why or "")
    kernel.wait_answering(timeout=60)
    assert kernel.evaluate(ok=CHECK, head="bytes(blob[:8]) != b'changed!'",
                           mapped="cuda_map[:4] == b'\\x7fELF'") == {
        "ok": "True", "head": "True", "mapped": "True"}
