"""The set-up works: CRIU dumps a live Python process holding a few hundred MiB, the process is
restored, and it goes on computing the same results it would have without the dump."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CRIU = os.environ.get("INFINIJUP_CRIU", "/opt/infinijup/criu/sbin/criu")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root (CAP_CHECKPOINT_RESTORE)"),
    pytest.mark.skipif(not os.access(CRIU, os.X_OK), reason=f"no CRIU at {CRIU}: run make criu"),
]

# The worker holds ~300 MiB (pseudo-random, incompressible, the same in every run), then prints a running checksum of a
# deterministic stream for each line appended to its command file, which it holds open mid-read.
WORKER = r"""
import hashlib, os, random, sys, time
blob = b"".join(random.Random(i).randbytes(2**20) for i in range(300))
rng = random.Random(1234)
h = hashlib.blake2b(blob[:4096])
cmd_path, out_path = sys.argv[1], sys.argv[2]
with open(out_path, "a", buffering=1) as out:
    out.write("ready %d\n" % len(blob))
    with open(cmd_path) as cmds:
        while True:
            line = cmds.readline()
            if not line:
                time.sleep(0.01)
                continue
            for _ in range(1000):
                h.update(rng.getrandbits(64).to_bytes(8, "little"))
            h.update(blob[rng.randrange(len(blob) - 4096):][:4096])
            out.write(h.hexdigest()[:16] + "\n")
"""


def _wait_lines(path: Path, n: int, timeout: float = 120) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"expected {n} lines in {path}, got {path.read_text()!r}")


def _start(tmp: Path, name: str) -> tuple[subprocess.Popen, Path, Path, int]:
    cmds = tmp / f"{name}.cmds"
    cmds.touch()
    out = tmp / f"{name}.out"
    script = tmp / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(cmds), str(out)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wfd = os.open(cmds, os.O_WRONLY | os.O_APPEND)
    _wait_lines(out, 1)
    return proc, cmds, out, wfd


def _criu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CRIU, *args], capture_output=True, text=True, timeout=120)


def test_dump_restore_continues_identically(tmp_path: Path) -> None:
    # A reference run: the same worker, never dumped.
    ref, _, ref_out, ref_w = _start(tmp_path, "ref")
    os.write(ref_w, b"x\n" * 6)
    reference = _wait_lines(ref_out, 7)[1:]
    ref.kill()
    ref.wait()
    os.close(ref_w)

    proc, cmds, out, wfd = _start(tmp_path, "live")
    pid = proc.pid
    os.write(wfd, b"x\n" * 3)
    before = _wait_lines(out, 4)[1:]
    assert before == reference[:3]

    images = tmp_path / "images"
    images.mkdir()
    dump = _criu("dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "--shell-job")
    if dump.returncode != 0:
        pytest.fail("criu dump failed:\n" + (images / "dump.log").read_text()[-3000:])
    image_bytes = sum(p.stat().st_size for p in images.iterdir())
    assert image_bytes > 300 * 2**20, image_bytes
    # Dumped without --leave-running, the process is gone; reap it so its pid is free again.
    assert proc.wait(timeout=120) == -signal.SIGKILL

    restore = _criu("restore", "-D", str(images), "-o", "restore.log", "--shell-job",
                    "--restore-detached")
    if restore.returncode != 0:
        log = images / "restore.log"
        pytest.fail("criu restore failed:\n" + restore.stderr + (log.read_text()[-3000:] if log.exists() else ""))
    try:
        os.kill(pid, 0)  # same pid again
        os.write(wfd, b"x\n" * 3)
        after = _wait_lines(out, 7)[4:]
        assert after == reference[3:6]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.close(wfd)
        shutil.rmtree(images, ignore_errors=True)
