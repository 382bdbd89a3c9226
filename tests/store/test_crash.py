"""Real crash tests: SIGKILL a committing or collecting process at every durable step."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import random_bytes, subprocess_env

from infinijup.store import Repository
from infinijup.store.check import check
from infinijup.store.checkout import checkout_dir
from infinijup.store.gc import gc

CHILD = str(Path(__file__).with_name("child.py"))
COMMIT_POINTS = ["after_pack", "after_pack:2", "after_index", "after_index:3", "after_commit",
                 "before_ref", "after_ref"]
GC_POINTS = ["gc_after_repack", "gc_after_commit_index", "gc_after_commit_files",
             "gc_after_pack_index", "gc_after_pack_files"]


def run_child(*args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = subprocess_env(**({"INFINIJUP_STORE_CRASH_AT": crash_at} if crash_at else {}))
    return subprocess.run([sys.executable, CHILD, *args], env=env, capture_output=True,
                          text=True, timeout=120)


def fresh_store(tmp_path: Path) -> tuple[Repository, Path, dict[str, bytes]]:
    """A store with one commit on 'main' (pack_size small so a commit writes many packs)."""
    repo = Repository.init(tmp_path / "store", pack_size=256 << 10)
    src = tmp_path / "src"
    src.mkdir()
    files = {"pages-1.img": random_bytes(1 << 20, seed=1), "core.img": b"core" * 100}
    for name, data in files.items():
        (src / name).write_bytes(data)
    repo.commit_dir(src, thread="main", message="base")
    return repo, src, files


def assert_intact(repo: Repository, tmp_path: Path, thread: str, files: dict[str, bytes]) -> None:
    report = check(repo, read_data=True)
    assert report.ok, report.problems
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    checkout_dir(repo, thread, out)
    for name, data in files.items():
        assert (out / name).read_bytes() == data


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_commit_killed_at_named_point(tmp_path: Path, point: str) -> None:
    repo, src, files = fresh_store(tmp_path)
    base = repo.resolve("main")
    (src / "pages-1.img").write_bytes(random_bytes(1 << 20, seed=2))
    r = run_child("commit", str(repo.path), str(src), "main", crash_at=point)
    assert r.returncode == -signal.SIGKILL, r.stderr
    repo = Repository.open(repo.path)
    tip = repo.resolve("main")
    if point == "after_ref":
        assert tip != base and repo.get_commit(tip).parents == (base,)
    else:
        assert tip == base  # the ref moves last: before it the old tip stands
        assert_intact(repo, tmp_path, "main", files)
    # the store keeps working: a new commit lands, gc cleans the leftovers
    c = repo.commit_dir(src, thread="main")
    assert c.parents == (tip,)
    gc(repo)
    after = check(repo, read_data=True)
    assert after.ok and not after.warnings, (after.problems, after.warnings)


@pytest.mark.parametrize("point", GC_POINTS)
def test_gc_killed_at_named_point(tmp_path: Path, point: str) -> None:
    repo, src, files = fresh_store(tmp_path)
    (src / "scratch.img").write_bytes(random_bytes(600_000, seed=3))
    repo.commit_dir(src, thread="scratch")
    (src / "scratch.img").unlink()
    keep_files = dict(files)
    (src / "more.img").write_bytes(random_bytes(300_000, seed=4))
    keep_files["more.img"] = (src / "more.img").read_bytes()
    with repo.writer() as w:  # one pack holding both live and dead objects: gc repacks it
        dead = w.add_bytes(random_bytes(400_000, seed=5))
        live = w.add_file(src / "more.img")
        w.commit({"dead.img": dead}, thread="dead")
        w.commit({**{n: w.add_file(src / n) for n in files}, "more.img": live}, thread="main")
    repo.delete_thread("scratch")
    repo.delete_thread("dead")
    r = run_child("gc", str(repo.path), crash_at=point)
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    repo = Repository.open(repo.path)
    assert_intact(repo, tmp_path, "main", keep_files)
    gc(repo)
    assert_intact(repo, tmp_path, "main", keep_files)
    assert not check(repo).warnings


def test_commit_killed_at_random_moments(tmp_path: Path) -> None:
    repo, src, files = fresh_store(tmp_path)
    base = repo.resolve("main")
    (src / "pages-1.img").write_bytes(random_bytes(6 << 20, seed=9))
    rng = random.Random(1234)
    env = subprocess_env()
    reported: set[str] = set()  # commits a child printed: they landed
    unreported = 0  # children killed before printing: their commit may or may not have landed
    for _ in range(8):
        p = subprocess.Popen([sys.executable, CHILD, "commit", str(repo.path), str(src), "main"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.05, 0.6))
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate()
        if out.strip():
            reported.add(out.decode().strip())
        else:
            unreported += 1
        fresh = Repository.open(repo.path)
        report = check(fresh, read_data=True)
        assert report.ok, report.problems
        fresh.close()
    repo = Repository.open(repo.path)
    landed = {c.id for c in repo.log("main")} - {base}
    # a kill can land between moving the ref and printing: such a commit is there too
    assert reported <= landed and len(landed) <= len(reported) + unreported
    assert repo.log("main")[-1].message == "base"
    gc(repo)
    assert check(repo, read_data=True).ok
