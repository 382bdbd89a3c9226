"""Several processes at once: concurrent commits both land; dead lock holders are harmless."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import random_bytes, subprocess_env

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.errors import StoreLocked
from infinijup.store.gc import gc
from infinijup.store.lock import FileLock

CHILD = str(Path(__file__).with_name("child.py"))


def test_two_processes_commit_at_once(tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store", pack_size=1 << 20)
    srcs = []
    for i in range(2):
        src = tmp_path / f"src{i}"
        src.mkdir()
        (src / "pages-1.img").write_bytes(random_bytes(8 << 20, seed=i))
        srcs.append(src)
    env = subprocess_env()
    procs = [subprocess.Popen([sys.executable, CHILD, "commit", str(repo.path), str(s), t],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s, t in [(srcs[0], "main"), (srcs[1], "main"), (srcs[0], "other")]]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ids = [o[0].strip() for o in outs]
    log = repo.log("main")
    assert {c.id for c in log} == set(ids[:2])  # both landed, one on top of the other
    assert log[0].parents == (log[1].id,)
    assert repo.threads() == {"main": log[0].id, "other": ids[2]}
    assert check(repo, read_data=True).ok


def test_lock_of_killed_process_is_taken_over(tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store")
    p = subprocess.Popen([sys.executable, CHILD, "hold-lock", str(repo.path), "60"],
                         env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "locked"
    assert repo.lock_path.read_text().split()[0] == str(p.pid)
    with pytest.raises(StoreLocked, match=f"pid {p.pid}"):
        FileLock(repo.lock_path, timeout=0.2).acquire()
    t = time.monotonic()
    with pytest.raises(StoreLocked):
        with Repository.open(repo.path, lock_timeout=0.3).writer():
            pass
    assert time.monotonic() - t < 5
    p.send_signal(signal.SIGKILL)
    p.wait()
    # the dead holder's pid is still in the file, but the lock is free
    assert repo.lock_path.read_text().split()[0] == str(p.pid)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    fresh = Repository.open(repo.path, lock_timeout=2)
    assert fresh.commit_dir(src, thread="t").thread == "t"
    assert gc(fresh).dry_run is False


def test_stale_lock_file_with_dead_pid(tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    repo.lock_path.write_text(f"{dead} 0\n")
    os.chmod(repo.lock_path, 0o600)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    assert Repository.open(repo.path, lock_timeout=1).commit_dir(src, thread="t")


def test_gc_waits_for_a_writer(tmp_path: Path) -> None:
    repo = Repository.init(tmp_path / "store")
    with repo.writer() as w:
        blob = w.add_bytes(random_bytes(100_000))
        with pytest.raises(StoreLocked):
            gc(Repository.open(repo.path, lock_timeout=0.2))
        w.commit({"f": blob}, thread="t")
    assert gc(repo).commits_removed == []
    assert repo.read_blob(blob.id) == random_bytes(100_000)
