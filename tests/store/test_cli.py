"""The ``store`` command line, run as a real subprocess."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import random_bytes, subprocess_env

from infinijup.store import Repository
from infinijup.store.cli import add_subparser
from infinijup.store.layout import pack_files


def cli(store: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "infinijup.store"]
    if store is not None:
        argv += ["--store", str(store)]
    return subprocess.run(argv + list(args), env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def populated(tmp_path: Path) -> tuple[Repository, str]:
    repo = Repository.init(tmp_path / "store")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "pages-1.img").write_bytes(random_bytes(300_000))
    (src / "sub" / "x").write_text("x")
    c = repo.commit_dir(src, thread="main", message="hello cli",
                        metadata={"notebook_path": "a.ipynb"})
    return repo, c.id


def test_read_commands(populated: tuple[Repository, str]) -> None:
    repo, cid = populated
    r = cli(repo.path, "log")
    assert r.returncode == 0 and cid[:12] in r.stdout and "hello cli" in r.stdout
    r = cli(repo.path, "log", "--thread", "main", "--json")
    assert r.returncode == 0 and f'"id": "{cid}"' in r.stdout
    r = cli(repo.path, "threads")
    assert r.returncode == 0 and r.stdout == f"main\t{cid[:12]}\n"
    r = cli(repo.path, "show", cid[:8])
    assert r.returncode == 0 and f"commit   {cid}" in r.stdout and "pages-1.img" in r.stdout
    assert "sub/" in r.stdout and "a.ipynb" in r.stdout
    r = cli(repo.path, "stats")
    assert r.returncode == 0 and "commits              1" in r.stdout


def test_maintenance_commands(populated: tuple[Repository, str]) -> None:
    repo, cid = populated
    r = cli(repo.path, "check", "--read-data")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout
    r = cli(repo.path, "gc", "--dry-run")
    assert r.returncode == 0 and r.stdout.startswith("would remove 0 commits")
    r = cli(repo.path, "rebuild-index")
    assert r.returncode == 0 and "1 commits" in r.stdout
    r = cli(repo.path, "gc")
    assert r.returncode == 0 and r.stdout.startswith("removed 0 commits")


def test_check_exit_1_on_damage(populated: tuple[Repository, str]) -> None:
    repo, _ = populated
    path = next(iter(pack_files(repo).values()))
    with open(path, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    r = cli(repo.path, "check")
    assert r.returncode == 0  # structure is fine
    r = cli(repo.path, "check", "--read-data")
    assert r.returncode == 1 and "problem: object" in r.stdout and path.name in r.stdout


@pytest.mark.parametrize("args,reason", [
    (["show", "nosuchthread"], "unknown_ref"),
    (["show", "abc"], "invalid_ref"),
    (["log", "--thread", "nope"], "unknown_ref"),
])
def test_errors_are_one_line_exit_2(populated: tuple[Repository, str], args: list[str],
                                    reason: str) -> None:
    repo, _ = populated
    r = cli(repo.path, *args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and f"[{reason}]" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_store_and_env_default(tmp_path: Path) -> None:
    r = cli(tmp_path / "none", "log")
    assert r.returncode == 2 and "[store_not_found]" in r.stderr and "Traceback" not in r.stderr
    Repository.init(tmp_path / "envstore")
    env = subprocess_env(INFINIJUP_STORE=str(tmp_path / "envstore"))
    r = subprocess.run([sys.executable, "-m", "infinijup.store", "stats"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and str(tmp_path / "envstore") in r.stdout


def test_add_subparser_wires_into_a_parent_cli(populated: tuple[Repository, str]) -> None:
    repo, cid = populated
    parser = argparse.ArgumentParser(prog="infinijup")
    add_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store", "--store", str(repo.path), "threads"])
    assert args.command == "store"
    assert args.store_handler(args) == 0
    assert os.fspath(repo.path) == args.store
