"""The helper's GPU arena (issues 13, 26): beside the socket, one tmpfs with huge pages per user
(``--gpu-arena-quota`` each, nosuid,nodev,noexec), made by ``hello``; what kernels that no
longer run left there goes. Real helper (``--gpu-arena always``: the mounts need root and
tmpfs, not a GPU), real mounts, a real second account, real kernel trees."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helperkit import (
    MISSING,
    PYTHON,
    SYSTEM_PYTHON,
    HelperDaemon,
    as_user,
    make_base,
    unused_uid,
    wait_for,
)

from infinijup.gpu import arena as server_arena
from infinijup.helper_client import HelperClient  # here: the second account may not read it
from infinijup_helper.arena import parse_quota

QUOTA = 8 << 20  # --gpu-arena-quota of these tests' helpers
MIB = 1 << 20


def mountinfo(path: str) -> list[dict[str, str]]:
    """The mounts at ``path``, lowest first: their per-mount and super block options."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                sep = fields.index("-")
                out.append({"mount": fields[5], "fstype": fields[sep + 1], "super": fields[-1]})
    return out


def mount_options(path: str) -> str | None:
    """The options of the mount at ``path``, or None where nothing is mounted."""
    mounts = mountinfo(path)
    if not mounts:
        return None
    m = mounts[-1]
    return f"{m['mount']} {m['super']} fstype={m['fstype']}"


def assert_safe_tmpfs(path: str, **super_options: str) -> None:
    mounts = mountinfo(path)
    assert len(mounts) == 1, f"{path}: {mounts}"
    m = mounts[0]
    assert m["fstype"] == "tmpfs", m
    assert {"nosuid", "nodev", "noexec"} <= set(m["mount"].split(",")), m
    have = set(m["super"].split(","))
    for name, value in super_options.items():
        assert f"{name}={value}" in have, (path, name, m)


def user(uid: int, gid: int | None = None) -> Any:
    """An identity for as_user: no account needed (a uid without one, say)."""
    return SimpleNamespace(pw_uid=uid, pw_gid=uid if gid is None else gid, pw_name=str(uid))


def start_arena_helper(*extra: str) -> tuple[HelperDaemon, str]:
    daemon = HelperDaemon(make_base(),
                          extra_args=("--gpu-arena", "always", "--gpu-arena-quota", "8m", *extra))
    return daemon, os.path.join(os.path.dirname(daemon.socket_path), "gpu-arena")


@pytest.fixture
def arena_helper():
    if MISSING:
        pytest.skip(MISSING)
    daemon, mount = start_arena_helper()
    daemon.start()
    yield daemon, mount
    daemon.stop()
    daemon.remove()


def client_of(daemon: HelperDaemon) -> Any:
    return HelperClient(daemon.socket_path, timeout=60)


def hello_as(account: Any, daemon: HelperDaemon) -> str:
    out = as_user(account, lambda: client_of(daemon).hello().arena_dir)
    assert "value" in out and out["value"], out
    return out["value"]


def fill(path: str, size: int) -> dict[str, Any]:
    """Write ``size`` bytes into a new file: how many went in, and the errno that stopped it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    written, chunk = 0, b"\xab" * MIB
    try:
        while written < size:
            written += os.write(fd, chunk[: size - written])
    except OSError as exc:
        return {"written": written, "errno": exc.errno}
    finally:
        os.close(fd)
    return {"written": written, "errno": None}


def write_kernel_files(arena_dir: str, *kernels: str) -> None:
    for kernel in kernels:
        os.makedirs(os.path.join(arena_dir, kernel, "sub"), exist_ok=True)
        Path(arena_dir, kernel, "segments").write_bytes(b"x" * 4096)
        Path(arena_dir, kernel, "sub", "more").write_bytes(b"y")
        os.symlink("/etc", os.path.join(arena_dir, kernel, "sub", "etc"))  # never followed


def test_hello_gives_each_user_a_private_huge_page_tmpfs_of_their_own(
        arena_helper, other_account, monkeypatch) -> None:
    daemon, mount = arena_helper
    assert_safe_tmpfs(mount, huge="within_size")
    st = os.lstat(mount)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711)

    mine = client_of(daemon).hello().arena_dir
    assert mine == os.path.join(mount, "0")
    theirs = hello_as(other_account, daemon)
    assert theirs == os.path.join(mount, str(other_account.pw_uid))
    for path, uid in ((mine, 0), (theirs, other_account.pw_uid)):
        assert_safe_tmpfs(path, huge="within_size", size="8192k")
        st = os.lstat(path)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o700)

    # Their directory is theirs to fill, but not to replace (it is a mount point in a
    # directory of root's), and a hello puts back what they changed about its root.
    def meddle() -> dict:
        out = {}
        for what, attempt in {
            "rmdir": lambda: os.rmdir(theirs),
            "rename": lambda: os.rename(theirs, theirs + "x"),
            "symlink beside": lambda: os.symlink("/tmp", os.path.join(mount, "999999")),
            "list the root": lambda: os.listdir(mount),
        }.items():
            try:
                attempt()
                out[what] = "done"
            except OSError as exc:
                out[what] = errno.errorcode[exc.errno]
        os.chmod(theirs, 0o777)
        return out

    out = as_user(other_account, meddle)
    assert out["value"] == {"rmdir": "EACCES", "rename": "EACCES",
                            "symlink beside": "EACCES", "list the root": "EACCES"}, out
    assert stat.S_IMODE(os.lstat(theirs).st_mode) == 0o777
    assert hello_as(other_account, daemon) == theirs
    assert stat.S_IMODE(os.lstat(theirs).st_mode) == 0o700

    # The server picks that directory as its arena root, by the helper's socket.
    monkeypatch.setenv("INFINIJUP_HELPER_SOCKET", daemon.socket_path)
    monkeypatch.delenv(server_arena.ROOT_ENV, raising=False)
    monkeypatch.delenv(server_arena.ALLOCATOR_ENV, raising=False)
    assert server_arena.prepare_root() == Path(mine)

    # A restarted helper takes the mounts as they are: nothing mounted twice.
    daemon.stop()
    daemon.start()
    assert hello_as(other_account, daemon) == theirs
    for path in (mount, mine, theirs):
        assert len(mountinfo(path)) == 1, mountinfo(path)


def test_a_user_past_their_quota_gets_enospc_and_nobody_else_notices(
        arena_helper, other_account) -> None:
    daemon, mount = arena_helper
    theirs = hello_as(other_account, daemon)
    mine = client_of(daemon).hello().arena_dir
    nobody = user(unused_uid())
    ghost = hello_as(nobody, daemon)

    out = as_user(other_account, lambda: fill(os.path.join(theirs, "big"), QUOTA + 2 * MIB))
    assert out["value"]["errno"] == errno.ENOSPC, out
    assert out["value"]["written"] <= QUOTA, out
    # the others' arenas are their own pools: full sized still
    assert fill(os.path.join(mine, "mine"), QUOTA - 2 * MIB) == {
        "written": QUOTA - 2 * MIB, "errno": None}
    out = as_user(nobody, lambda: fill(os.path.join(ghost, "theirs"), QUOTA - 2 * MIB))
    assert out["value"] == {"written": QUOTA - 2 * MIB, "errno": None}, out
    # and their own full arena takes nothing more, from them or from root
    out = as_user(other_account, lambda: fill(os.path.join(theirs, "more"), 4 * MIB))
    assert out["value"]["errno"] == errno.ENOSPC, out
    assert fill(os.path.join(theirs, "roots"), 4 * MIB)["errno"] == errno.ENOSPC


def test_nothing_in_an_arena_runs_or_opens_a_device(arena_helper, other_account) -> None:
    daemon, mount = arena_helper
    theirs = hello_as(other_account, daemon)
    mine = client_of(daemon).hello().arena_dir
    for path in (mount, mine, theirs):
        assert_safe_tmpfs(path)

    # an executable (a copy of true) and a script, in root's arena and in theirs
    for d in (mine, theirs):
        shutil.copy("/bin/true", os.path.join(d, "true"))
        Path(d, "script").write_text("#!/bin/sh\nexit 0\n")
        for name in ("true", "script"):
            os.chmod(os.path.join(d, name), 0o755)
            os.chown(os.path.join(d, name), os.stat(d).st_uid, os.stat(d).st_gid)
    subprocess.run(["/bin/true"], check=True)  # it runs elsewhere

    def run_all(d: str) -> dict:
        out = {}
        for name in ("true", "script"):
            try:
                subprocess.run([os.path.join(d, name)], check=False)
                out[name] = "ran"
            except OSError as exc:
                out[name] = errno.errorcode[exc.errno]
        return out

    assert run_all(mine) == {"true": "EACCES", "script": "EACCES"}
    assert as_user(other_account, lambda: run_all(theirs))["value"] == \
        {"true": "EACCES", "script": "EACCES"}

    # a device node made there (by root: no one else can) opens nothing
    os.mknod(os.path.join(mine, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(PermissionError):
        open(os.path.join(mine, "null"), "rb").close()


def test_another_user_cannot_enter_an_arena(arena_helper, other_account) -> None:
    daemon, _mount = arena_helper
    mine = client_of(daemon).hello().arena_dir
    theirs = hello_as(other_account, daemon)
    Path(theirs, "k").mkdir()
    Path(theirs, "k", "segments").write_bytes(b"secret")
    Path(mine, "segments").write_bytes(b"secret")
    os.chmod(os.path.join(mine, "segments"), 0o666)  # open to all, but behind 0700

    def try_all(d: str) -> dict:
        out = {}
        for what, attempt in {
            "chdir": lambda: os.chdir(d),
            "list": lambda: os.listdir(d),
            "read": lambda: Path(d, "segments").read_bytes(),
            "read below": lambda: Path(d, "k", "segments").read_bytes(),
            "create": lambda: Path(d, "planted").write_bytes(b""),
        }.items():
            try:
                attempt()
                out[what] = "done"
            except OSError as exc:
                out[what] = errno.errorcode[exc.errno]
        return out

    refused = dict.fromkeys(("chdir", "list", "read", "read below", "create"), "EACCES")
    assert as_user(other_account, lambda: try_all(mine))["value"] == refused
    nobody = user(unused_uid())
    hello_as(nobody, daemon)
    assert as_user(nobody, lambda: try_all(theirs))["value"] == refused
    assert as_user(nobody, lambda: try_all(mine))["value"] == refused


def spawn_as(account: Any, daemon: HelperDaemon, kernel_id: str) -> int:
    def spawn() -> int:
        client = client_of(daemon)
        work = client.work_dir()
        env = {"PATH": "/usr/bin:/bin", "INFINIJUP_KERNEL_ID": kernel_id}
        return client.spawn([SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"], env, work,
                            f"{work}/{kernel_id}.log")

    out = as_user(account, spawn)
    assert "value" in out, out
    return out["value"]


def kill_as(account: Any, daemon: HelperDaemon, pid: int) -> None:
    out = as_user(account, lambda: client_of(daemon).kill(pid))
    assert "value" in out, out


def test_a_kernels_files_go_when_it_ends(arena_helper, other_account, trees) -> None:
    daemon, _mount = arena_helper
    theirs = hello_as(other_account, daemon)
    k1 = trees.add(spawn_as(other_account, daemon, "k1"))
    k2 = trees.add(spawn_as(other_account, daemon, "k2"))
    as_user(other_account, lambda: write_kernel_files(theirs, "k1", "k2", "gone-long-ago"))
    Path(theirs, "go-0123abcd").write_text('{"source": null}')  # a snapshot under way
    before = set(os.listdir(theirs))

    kill_as(other_account, daemon, k1)  # k2 still runs: only k1's directory goes
    assert set(os.listdir(theirs)) == before - {"k1"}
    assert os.path.exists("/etc/passwd")

    kill_as(other_account, daemon, k2)  # their last kernel: every kernel's directory goes
    assert os.listdir(theirs) == ["go-0123abcd"]
    assert_safe_tmpfs(theirs)


def test_a_kernel_that_dies_by_itself_leaves_nothing_either(
        arena_helper, other_account, trees) -> None:
    """No kill op: the helper's reaper sees the tree end."""
    daemon, _mount = arena_helper
    theirs = hello_as(other_account, daemon)
    k1 = trees.add(spawn_as(other_account, daemon, "k1"))
    as_user(other_account, lambda: write_kernel_files(theirs, "k1"))
    os.kill(k1, signal.SIGKILL)
    wait_for(lambda: os.listdir(theirs) == [], timeout=60, what="k1's directory to go")
    assert f"tree {k1} of uid {other_account.pw_uid} ended" in daemon.log()


def test_a_restored_or_unnamed_kernel_keeps_what_it_may_answer_to(
        arena_helper, other_account, trees) -> None:
    """A tree whose kernel id the helper does not know (spawned without one here; restored,
    in life) may answer to any directory: while it runs, nothing another tree leaves goes."""
    daemon, _mount = arena_helper
    theirs = hello_as(other_account, daemon)
    k1 = trees.add(spawn_as(other_account, daemon, "k1"))
    unnamed = trees.add(spawn_as(other_account, daemon, ""))
    as_user(other_account, lambda: write_kernel_files(theirs, "k1", "k2"))
    kill_as(other_account, daemon, k1)
    assert sorted(os.listdir(theirs)) == ["k1", "k2"]
    kill_as(other_account, daemon, unnamed)
    assert os.listdir(theirs) == []


def test_a_helper_start_removes_what_no_running_kernel_needs(
        arena_helper, other_account, trees) -> None:
    daemon, mount = arena_helper
    mine = client_of(daemon).hello().arena_dir
    theirs = hello_as(other_account, daemon)
    nobody = user(unused_uid())  # an account deleted since (a uid without a passwd entry)
    ghost = hello_as(nobody, daemon)
    running = trees.add(spawn_as(other_account, daemon, "k1"))

    write_kernel_files(mine, "root-kernel")
    Path(mine, "go-feed").write_text("{}")
    as_user(other_account, lambda: write_kernel_files(theirs, "k1", "k2"))
    as_user(nobody, lambda: write_kernel_files(ghost, "k9"))
    daemon.stop()
    daemon.start()

    # root runs no kernel: its kernels' directories went, its go file stayed, its mount too
    assert os.listdir(mine) == ["go-feed"], daemon.log()[-4000:]
    assert_safe_tmpfs(mine, size="8192k")
    # theirs runs a kernel (adopted by this helper): the helper cannot tell which directory
    # it answers to, so all stay while it runs
    assert sorted(os.listdir(theirs)) == ["k1", "k2"]
    assert_safe_tmpfs(theirs, size="8192k")
    # a uid without an account loses its arena altogether
    assert mountinfo(ghost) == []
    assert not os.path.exists(ghost)
    assert sorted(os.listdir(mount)) == sorted(["0", str(other_account.pw_uid)])
    assert os.path.exists("/etc/passwd")

    kill_as(other_account, daemon, running)  # their last tree (kernel id unknown: adopted)
    assert os.listdir(theirs) == []
    assert hello_as(nobody, daemon) == ghost  # a uid that comes back gets a fresh one
    assert os.listdir(ghost) == []
    assert_safe_tmpfs(ghost, size="8192k")


def test_a_new_helper_tightens_the_one_shared_arena_of_before(other_account) -> None:
    """Issue 13's helpers mounted one tmpfs for everyone, without nosuid,nodev,noexec, and
    made each user a directory in it: a new helper makes it safe and gives each user a mount."""
    if MISSING:
        pytest.skip(MISSING)
    daemon, mount = start_arena_helper()
    try:
        os.makedirs(mount, mode=0o711)
        subprocess.run(["mount", "-t", "tmpfs", "-o",
                        "huge=within_size,size=50%,mode=0711,uid=0,gid=0", "tmpfs", mount],
                       check=True)
        old = os.path.join(mount, str(other_account.pw_uid))
        os.mkdir(old, 0o700)
        write_kernel_files(old, "k1")
        os.chown(old, other_account.pw_uid, other_account.pw_gid)
        daemon.start()
        assert_safe_tmpfs(mount)
        assert os.listdir(mount) == []
        assert hello_as(other_account, daemon) == old
        assert_safe_tmpfs(old, size="8192k")
        assert os.listdir(old) == []
    finally:
        daemon.stop()
        daemon.remove()


def test_the_quota_option() -> None:
    for good in ("50%", "100%", "1%", "8m", "8M", "64G", "1t", "1048576"):
        assert parse_quota(good) == good
    for bad in ("0", "0%", "00", "101%", "-1", "8mb", "1.5g", "", "50 %", "size=1m,nosuid"):
        with pytest.raises(ValueError):
            parse_quota(bad)
    run = subprocess.run([PYTHON, "-m", "infinijup_helper", "--criu", "/bin/true",
                          "--gpu-arena-quota", "0", "--help"],
                         capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert run.returncode == 2 and "--gpu-arena-quota" in run.stderr, run


def test_by_default_the_arena_is_there_only_where_cuda_is(helper, client) -> None:
    info = client.hello()
    mount = os.path.join(os.path.dirname(helper.socket_path), "gpu-arena")
    if info.features["cuda"]:
        assert info.arena_dir == os.path.join(mount, "0")
        assert "huge=within_size" in (mount_options(mount) or "")
        assert "huge=within_size" in (mount_options(info.arena_dir) or "")
    else:
        assert info.arena_dir is None
        assert not os.path.exists(mount)
