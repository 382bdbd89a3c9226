"""A lazy restore on a full disk (issue 32's faults): the helper's work dir is a small tmpfs,
filled to the last byte after the dump. The restore fails with the reason before the kernel
it would replace is touched, no page daemon or userfaultfd is left, and once there is room
the same images restore lazily, every byte right."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helperkit import HelperDaemon, Kernel, make_base, needs_root_and_criu

pytestmark = needs_root_and_criu

FILL = ("import os, hashlib\nblob = bytearray(os.urandom(32 << 20))\n"
        "digest = hashlib.blake2b(blob).hexdigest()")
CHECK = "hashlib.blake2b(blob).hexdigest() == digest"


@pytest.fixture(scope="module")
def helper() -> Iterator[HelperDaemon]:
    """This module's own helper, its work dir on a 160 MiB tmpfs."""
    base = make_base()
    work = base / "work"
    work.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m,mode=0755", "tmpfs", str(work)],
                   check=True)
    daemon = HelperDaemon(base)
    daemon.start()
    yield daemon
    daemon.stop()
    subprocess.run(["umount", "-l", str(work)], check=False)
    daemon.remove()


def _fill_up(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for chunk in (1 << 20, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\1" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)


def _daemons(helper) -> list[int]:  # noqa: ANN001
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == helper.proc.pid and b"lazy-pages" in cmd:
            found.append(int(entry))
    return found


def _uffds_held(helper) -> int:  # noqa: ANN001
    fds = f"/proc/{helper.proc.pid}/fd"
    count = 0
    for name in os.listdir(fds):
        try:
            count += os.readlink(f"{fds}/{name}") == "anon_inode:[userfaultfd]"
        except OSError:
            continue
    return count


def test_a_lazy_restore_on_a_full_disk_fails_before_the_kernel_is_touched(
        client, kernel: Kernel, trees, helper) -> None:
    kernel.execute(FILL, timeout=120)
    images = os.path.join(client.work_dir(), "full-disk")
    client.dump(kernel.pid, images)
    kernel.execute("blob[:8] = b'changed!'")  # the live kernel moves on
    filler = Path(client.work_dir()) / "filler"
    _fill_up(filler)

    with pytest.raises(Exception) as failed:  # noqa: PT011 - the client's error, checked below
        client.restore(images, replace_pid=kernel.pid, lazy=True)
    assert os.strerror(errno.ENOSPC) in str(failed.value), failed.value
    # the kernel it would have replaced runs on as it was; nothing of a stream is left
    assert kernel.evaluate(head="bytes(blob[:8])") == {"head": "b'changed!'"}
    assert _daemons(helper) == [] and _uffds_held(helper) == 0

    filler.unlink()
    restored = client.restore(images, replace_pid=kernel.pid, lazy=True)
    trees.add(restored.pid)
    kernel.wait_answering(timeout=60)
    assert kernel.evaluate(ok=CHECK, head="bytes(blob[:8]) != b'changed!'") == {
        "ok": "True", "head": "True"}
    deadline = time.monotonic() + 120  # hang guard only
    while (pages := client.status(restored.pid).pages)["state"] == "streaming":
        assert time.monotonic() < deadline, pages
        time.sleep(0.05)
    assert pages["state"] == "resident", pages
    client.release(images)
