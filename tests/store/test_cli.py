"""The ``infinijup`` command line as a person runs it: the installed ``infinijup`` script (the
project's entry point, next to this Python), as a subprocess, exit codes asserted.

Exit status: 0 success, 1 ``store check`` found a problem (and names it), 2 an error.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import random_bytes, subprocess_env

from infinijup.store import Repository
from infinijup.store.layout import pack_files

INFINIJUP = Path(sys.executable).parent / "infinijup"
COMMANDS = ("log", "threads", "show", "check", "gc", "stats", "rebuild-index")


def run(*args: str, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert INFINIJUP.is_file(), f"no installed entry point at {INFINIJUP}: run make setup"
    return subprocess.run([str(INFINIJUP), *args], env=env or subprocess_env(),
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def store(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``infinijup store --store PATH ARGS``."""
    return run("store", "--store", str(path), *args)


@pytest.fixture
def populated(tmp_path: Path) -> tuple[Path, str]:
    with Repository.init(tmp_path / "store") as repo:
        src = tmp_path / "src"
        (src / "sub").mkdir(parents=True)
        (src / "pages-1.img").write_bytes(random_bytes(300_000))
        (src / "sub" / "x").write_text("x")
        c = repo.commit_dir(src, thread="main", message="hello cli",
                            metadata={"notebook_path": "a.ipynb"})
    return tmp_path / "store", c.id


def test_help_lists_every_command(tmp_path: Path) -> None:
    r = run("--help", cwd=tmp_path)
    assert r.returncode == 0 and "store" in r.stdout and "helper" in r.stdout, r
    r = run("store", "--help", cwd=tmp_path)
    assert r.returncode == 0, r
    for command in (*COMMANDS, "--store PATH"):
        assert command in r.stdout, (command, r.stdout)
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("infinijup "), r
    # no command, an unknown one, a store command missing: usage on stderr, exit 2
    for argv in ([], ["nope"], ["store"], ["store", "show"]):
        r = run(*argv, cwd=tmp_path)
        assert r.returncode == 2 and "usage:" in r.stderr and r.stdout == "", (argv, r)


def test_read_commands(populated: tuple[Path, str]) -> None:
    path, cid = populated
    r = store(path, "log")
    assert r.returncode == 0 and cid[:12] in r.stdout and "hello cli" in r.stdout, r
    r = store(path, "log", "--thread", "main", "--json")
    assert r.returncode == 0 and f'"id": "{cid}"' in r.stdout, r
    r = store(path, "threads")
    assert r.returncode == 0 and r.stdout == f"main\t{cid[:12]}\n", r
    r = store(path, "show", cid[:8])
    assert r.returncode == 0 and f"commit   {cid}" in r.stdout and "pages-1.img" in r.stdout, r
    assert "sub/" in r.stdout and "a.ipynb" in r.stdout
    r = store(path, "show", "main")
    assert r.returncode == 0 and f"commit   {cid}" in r.stdout, r
    r = store(path, "stats")
    assert r.returncode == 0, r
    stats = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert stats["path"] == str(path) and stats["commits"] == "1" and stats["threads"] == "1"


def test_store_option_before_or_after_the_command_and_env_default(
        populated: tuple[Path, str], tmp_path: Path) -> None:
    path, cid = populated
    want = f"main\t{cid[:12]}\n"
    assert run("store", "--store", str(path), "threads").stdout == want
    assert run("store", "threads", "--store", str(path)).stdout == want
    r = run("store", "threads", env=subprocess_env(INFINIJUP_STORE=str(path)), cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == want, r
    # given twice, the one after the command wins
    r = run("store", "--store", str(tmp_path / "none"), "threads", "--store", str(path))
    assert r.returncode == 0 and r.stdout == want, r


def test_check_gc_rebuild_index(populated: tuple[Path, str], tmp_path: Path) -> None:
    path, cid = populated
    r = store(path, "check", "--read-data")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r
    assert "objects re-hashed" in r.stdout and "1 commits" in r.stdout
    # a second thread, then dropped: gc --dry-run reports it and removes nothing; gc removes it
    src = tmp_path / "src2"
    src.mkdir()
    (src / "pages-1.img").write_bytes(random_bytes(200_000, seed=9))
    with Repository.open(path) as repo:
        other = repo.commit_dir(src, thread="side", message="to drop").id
        repo.delete_thread("side")
    r = store(path, "gc", "--dry-run")
    assert r.returncode == 0 and r.stdout.startswith("would remove 1 commits"), r
    with Repository.open(path) as repo:
        assert repo.get_commit(other).id == other  # still there
    r = store(path, "gc")
    assert r.returncode == 0 and r.stdout.startswith("removed 1 commits"), r
    r = store(path, "gc", "--dry-run")
    assert r.returncode == 0 and r.stdout.startswith("would remove 0 commits, 0 objects"), r
    r = store(path, "check", "--read-data")
    assert r.returncode == 0 and "warning" not in r.stdout and r.stdout.strip().endswith("ok"), r
    r = store(path, "rebuild-index")
    assert r.returncode == 0 and "1 commits" in r.stdout and "skipped 0 damaged packs" in r.stdout
    r = store(path, "log")
    assert r.returncode == 0 and cid[:12] in r.stdout and other[:12] not in r.stdout, r


def test_check_names_a_damaged_pack_and_exits_1(populated: tuple[Path, str]) -> None:
    path, _ = populated
    with Repository.open(path) as repo:
        (pack,) = pack_files(repo).values()
    with open(pack, "r+b") as f:  # one bit flipped inside a stored object
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    r = store(path, "check")
    assert r.returncode == 0, r  # the structure is intact: only re-reading finds it
    r = store(path, "check", "--read-data")
    assert r.returncode == 1, r
    problems = [line for line in r.stdout.splitlines() if line.startswith("problem: ")]
    assert problems and all(pack.name in p for p in problems), r.stdout
    assert r.stdout.strip().endswith(f"{len(problems)} problem(s) found"), r.stdout
    # a pack gone entirely: plain check sees it
    pack.unlink()
    r = store(path, "check")
    assert r.returncode == 1 and pack.name in r.stdout, r


@pytest.mark.parametrize("args,reason", [
    (["show", "nosuchthread"], "unknown_ref"),
    (["show", "abc"], "invalid_ref"),
    (["log", "--thread", "nope"], "unknown_ref"),
])
def test_errors_are_one_line_exit_2(populated: tuple[Path, str], args: list[str],
                                    reason: str) -> None:
    path, _ = populated
    r = store(path, *args)
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and f"[{reason}]" in r.stderr and r.stdout == ""
    assert "Traceback" not in r.stderr


def test_missing_store_exits_2(tmp_path: Path) -> None:
    for command in ("log", "threads", "check", "gc", "stats", "rebuild-index"):
        r = store(tmp_path / "none", command)
        assert r.returncode == 2, (command, r)
        assert "[store_not_found]" in r.stderr and "Traceback" not in r.stderr


def test_python_dash_m_store_still_works(populated: tuple[Path, str]) -> None:
    path, cid = populated
    r = subprocess.run([sys.executable, "-m", "infinijup.store", "--store", str(path), "threads"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"main\t{cid[:12]}\n", r


def test_helper_command(tmp_path: Path) -> None:
    r = run("helper", env=subprocess_env(INFINIJUP_HELPER_SOCKET=str(tmp_path / "no.sock")))
    assert r.returncode == 2 and "helper is not running" in r.stderr, r
    assert "sudo make helper" in r.stderr and "Traceback" not in r.stderr

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helper"))
    from helperkit import MISSING, HelperDaemon, make_base

    if MISSING:
        pytest.skip(f"the live part needs the helper: {MISSING}")
    daemon = HelperDaemon(make_base())
    daemon.start()
    try:
        r = run("helper", env=subprocess_env(INFINIJUP_HELPER_SOCKET=daemon.socket_path))
        assert r.returncode == 0, r
        info = dict(line.split(": ", 1) for line in r.stdout.splitlines())
        assert info["uid"] == "0" and info["work_dir"].startswith(daemon.work_dir), info
    finally:
        daemon.stop()
        shutil.rmtree(daemon.base, ignore_errors=True)
