"""A real CRIU image of a running Python process through the store."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir

CRIU = os.environ.get("INFINIJUP_CRIU", "/opt/infinijup/criu/sbin/criu")
PYCRIU = os.environ.get("INFINIJUP_PYCRIU", "/opt/infinijup/criu/python")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(CRIU, os.X_OK),
    reason="needs root and CRIU (make criu) to dump a real process")

HOLDER = """
import numpy as np, signal, sys, time
a = np.random.default_rng(1).random((24 << 20) // 8)
b = (np.arange((16 << 20) // 8, dtype=np.int64) * 7919) % 1000003
objs = [{"i": i, "s": "row-%d" % i} for i in range(20000)]
def dirty(*_):
    r = np.random.default_rng(2)
    for arr in (a, b):  # 1% of the pages of each array, scattered: 8 bytes at random places
        v = arr.view(np.uint8)
        n = v.size // 4096
        for p in r.choice(n, n // 100, replace=False):
            at = p * 4096 + int(r.integers(0, 4088))
            v[at : at + 8] = r.integers(0, 256, 8, dtype=np.uint8)
    print("dirty", flush=True)
signal.signal(signal.SIGUSR1, dirty)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def dump(pid: int, target: Path) -> None:
    target.mkdir()
    r = subprocess.run([CRIU, "dump", "-t", str(pid), "-D", str(target), "--shell-job",
                        "--leave-running", "-o", "dump.log"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (target / "dump.log").read_text()[-2000:]
    (target / "dump.log").unlink()
    (target / "stats-dump").unlink(missing_ok=True)


def test_real_criu_image_roundtrip_and_dedup(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        dump(p.pid, tmp_path / "d1")
        p.send_signal(signal.SIGUSR1)
        assert p.stdout.readline().strip() == "dirty"
        time.sleep(0.1)
        dump(p.pid, tmp_path / "d2")
    finally:
        p.kill()
        p.wait()
    pages = next((tmp_path / "d1").glob("pages-*.img"))
    assert pages.stat().st_size > 30 << 20
    repo = Repository.init(tmp_path / "store")
    c1 = repo.commit_dir(tmp_path / "d1", thread="kernel", metadata={"kernel_id": "k"})
    c2 = repo.commit_dir(tmp_path / "d2", thread="kernel")
    assert c1.stats["stored_bytes"] < c1.stats["image_bytes"]  # some of it compresses
    # the second dump differs in 1% of the arrays' pages (and whatever the interpreter
    # touched meanwhile): page deltas store those pages, not the 32 KiB chunks around them
    assert c2.stats["delta_chunks"] > 0, c2.stats
    assert c2.stats["stored_bytes"] < 0.03 * c2.stats["image_bytes"], c2.stats
    for commit, src in ((c1, "d1"), (c2, "d2")):
        out = tmp_path / f"out-{src}"
        checkout_dir(repo, commit.id, out)
        r = subprocess.run(["diff", "-r", str(tmp_path / src), str(out)], capture_output=True)
        assert r.returncode == 0, r.stdout[:500]
    assert check(repo, read_data=True).ok
    shutil.rmtree(tmp_path / "store")


def test_checked_out_image_parses_with_pycriu(tmp_path: Path) -> None:
    sys.path.insert(0, PYCRIU)
    try:
        pycriu = pytest.importorskip("pycriu", reason="pycriu (and protobuf) not importable")
    finally:
        sys.path.remove(PYCRIU)
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        dump(p.pid, tmp_path / "d")
    finally:
        p.kill()
        p.wait()
    repo = Repository.init(tmp_path / "store")
    repo.commit_dir(tmp_path / "d", thread="k")
    checkout_dir(repo, "k", tmp_path / "out")
    with open(tmp_path / "out" / "inventory.img", "rb") as f:
        inv = pycriu.images.load(f)
    assert inv["magic"] == "INVENTORY"
    with open(next((tmp_path / "out").glob("pagemap-*.img")), "rb") as f:
        assert pycriu.images.load(f)["magic"] == "PAGEMAP"
