"""Issue 10's attacks, tried for real by a second real account against a real helper.

Each test makes the attack, asserts that it fails with a clear error, and that nothing outside
the attacker's own files changed: the target's bytes, owner and mode, the helper's socket, and
other users' operations, which complete meanwhile. Races run in loops bounded by a count of
attempts, never by time. docs/security.md lists which test covers which attack.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helperkit import (
    HOLDER,
    PYTHON,
    SYSTEM_PYTHON,
    HelperDaemon,
    Trees,
    as_user,
    kernel_env,
    make_base,
    needs_root_and_criu,
    snapshot_of,
    user_argv,
    wait_for,
)

pytestmark = needs_root_and_criu

@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A root-owned directory (0755) with a root-owned file in it: what the attacks aim at."""
    base = Path(f"/var/tmp/ijsec-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    (base / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n" * 4)
    os.chmod(base / "passwd", 0o644)
    private = base / "private"
    private.mkdir(mode=0o700)
    (private / "secret").write_text("only root may read this\n")
    yield base
    shutil.rmtree(base, ignore_errors=True)


class Account:
    """The second account, driving the helper as itself."""

    def __init__(self, helper: HelperDaemon, user: Any, trees: Trees) -> None:
        from infinijup.helper_client import HelperClient

        self.user = user
        self.trees = trees
        self.client = HelperClient(helper.socket_path, timeout=300)
        self.work = self.call(self.client.work_dir)["value"]

    def call(self, fn: Any) -> dict[str, Any]:
        return as_user(self.user, fn)

    def own(self, path: str | Path) -> None:
        os.lchown(path, self.user.pw_uid, self.user.pw_gid)

    def spawn_holder(self, d: Path, mode: str, cwd: str | None = None) -> int:
        script = Path(self.work) / "holder.py"
        script.write_text(HOLDER)
        self.own(script)
        log = os.path.join(self.work, f"holder-{mode}-{secrets.token_hex(3)}.log")
        argv = [SYSTEM_PYTHON, str(script), str(d), mode]
        env = {"PATH": "/usr/bin:/bin", "HOME": self.work}
        got = self.call(lambda: self.client.spawn(argv, env, cwd or self.work, log))
        assert "value" in got, got
        root = self.trees.add(got["value"])
        wait_for(lambda: "ready" in (Path(log).read_text() if os.path.exists(log) else ""),
                 what=f"the {mode} holder to be ready")
        return root


@pytest.fixture
def account(helper, other_account, trees) -> Account:
    return Account(helper, other_account, trees)


def swap_for_symlink(d: Path, target: Path, account: Account) -> None:
    """The attacker replaces their directory ``d`` by a symlink to ``target``."""
    shutil.rmtree(d)
    d.symlink_to(target)
    account.own(d)


def dump_then_swap_and_restore(account: Account, d: Path, mode: str, target: Path,
                               cwd: str | None = None) -> dict[str, Any]:
    root = account.spawn_holder(d, mode, cwd=cwd)
    images = os.path.join(account.work, f"images-{mode}-{secrets.token_hex(3)}")
    dumped = account.call(lambda: account.client.dump(root, images).__dict__)
    assert "value" in dumped, dumped
    # Positive control: these very images restore fine while the paths are the attacker's
    # own, so a refusal below comes from the swap, not from something else.
    restored = account.call(lambda: account.client.restore(images, replace_pid=root).pid)
    assert "value" in restored, restored
    root = account.trees.add(restored["value"])
    assert account.call(lambda: account.client.kill(root)) == {"value": None}
    swap_for_symlink(d, target, account)
    return account.call(lambda: account.client.restore(images))


def assert_refused_by_permissions(result: dict[str, Any]) -> None:
    assert result.get("error") == "criu_failed", result
    assert "Permission denied" in result["message"], result["message"]


def no_process_holds(path: str, uid: int) -> bool:
    """No process of ``uid`` has ``path`` open."""
    real = os.path.realpath(path)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == real:
                    return False
        except OSError:
            continue
    return True


def test_restore_does_not_reopen_files_through_a_swapped_symlink(account, root_dir) -> None:
    """Attack 1: the kernel holds ~/d/passwd read-write (same size and mode as a root-owned
    passwd); ~/d becomes a symlink to the root-owned directory; restore. CRIU reopens files as
    the caller, so it gets EACCES instead of a writable root-owned file."""
    d = Path(account.work) / f"d-{secrets.token_hex(3)}"
    d.mkdir()
    shutil.copy(root_dir / "passwd", d / "passwd")
    os.chmod(d / "passwd", 0o644)
    account.own(d)
    account.own(d / "passwd")
    before = snapshot_of(str(root_dir / "passwd"))
    result = dump_then_swap_and_restore(account, d, "file", root_dir)
    assert_refused_by_permissions(result)
    assert snapshot_of(str(root_dir / "passwd")) == before
    assert no_process_holds(str(root_dir / "passwd"), account.user.pw_uid)


def test_restore_does_not_bind_unix_sockets_through_a_swapped_symlink(helper, account) -> None:
    """Attack 1, socket variant: the kernel listens on ~/d/helper.sock; ~/d becomes a symlink
    to the helper's own socket directory; restore. Binding (and unlinking a stale socket) is
    done as the caller: refused, and the helper's socket is untouched and still serves."""
    run_dir = Path(helper.socket_path).parent
    d = Path(account.work) / f"d-{secrets.token_hex(3)}"
    d.mkdir()
    account.own(d)
    before = snapshot_of(helper.socket_path)
    result = dump_then_swap_and_restore(account, d, "socket", run_dir)
    assert result.get("error") == "criu_failed", result
    assert snapshot_of(helper.socket_path) == before
    assert os.stat(helper.socket_path).st_uid == 0
    from infinijup.helper_client import HelperClient

    assert HelperClient(helper.socket_path, timeout=30).hello().uid == 0  # root still served


def test_restore_does_not_enter_a_swapped_cwd(account, root_dir) -> None:
    """Attack 1, cwd variant: the kernel's cwd is ~/d; ~/d becomes a symlink to a root-only
    directory (a cwd inside it would reach its files by relative paths). Refused."""
    d = Path(account.work) / f"d-{secrets.token_hex(3)}"
    d.mkdir()
    account.own(d)
    before = sorted(os.listdir(root_dir / "private"))
    result = dump_then_swap_and_restore(account, d, "cwd", root_dir / "private", cwd=str(d))
    assert_refused_by_permissions(result)
    assert sorted(os.listdir(root_dir / "private")) == before


def test_restore_does_not_create_ghost_files_through_a_swapped_symlink(account, root_dir):
    """Attack 1, ghost file variant: the kernel holds a deleted file of ~/d, which CRIU
    recreates at restore; ~/d becomes a symlink to a root-owned directory. Creating it there
    is refused (it would be a file of the attacker's content in root's directory)."""
    d = Path(account.work) / f"d-{secrets.token_hex(3)}"
    d.mkdir()
    account.own(d)
    before = sorted(os.listdir(root_dir))
    result = dump_then_swap_and_restore(account, d, "ghost", root_dir)
    assert_refused_by_permissions(result)
    assert sorted(os.listdir(root_dir)) == before


# --- the registry: which pids are trees, and whose -----------------------------------------------


def _user_process(account: Account, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(user_argv(account.user, argv), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def test_a_users_own_namespace_init_is_not_a_tree(account) -> None:
    """Attack 7: a PID-namespace init the user made (unshare) used to pass as a tree root;
    a fake ``nsinit.py --owner <victim>`` command line used to pass as another user's init.
    The helper acts only on trees it recorded itself: both are refused, as is a plain
    process of the user's, and the server-side orphan finder ignores the fake."""
    from infinijup.engine.orphans import tree_root_of

    ns_init = _user_process(account, ["unshare", "--user", "--map-root-user", "--pid",
                                      "--fork", "--kill-child", "sleep", "600"])
    fake_dir = Path(account.work) / f"x-{secrets.token_hex(3)}" / "infinijup_helper"
    fake_dir.mkdir(parents=True)
    (fake_dir / "nsinit.py").write_text("import time\ntime.sleep(600)\n")
    for p in (fake_dir.parent, fake_dir, fake_dir / "nsinit.py"):
        account.own(p)
    fake = _user_process(account, [SYSTEM_PYTHON, "-I", str(fake_dir / "nsinit.py"),
                                   "--owner", "0"])
    try:
        wait_for(lambda: any(_is_namespace_init(c) for c in _children(ns_init.pid)),
                 what="the user's namespace init")
        (inner,) = [c for c in _children(ns_init.pid) if _is_namespace_init(c)]
        for pid in (inner, fake.pid, ns_init.pid):
            for op in ("dump", "kill", "signal", "restore over"):
                result = account.call(lambda pid=pid, op=op: {
                    "dump": lambda: account.client.dump(pid, account.work + "/stolen"),
                    "kill": lambda: account.client.kill(pid),
                    "signal": lambda: account.client.signal(pid, signal.SIGTERM),
                    "restore over": lambda: account.client.restore(account.work + "/none",
                                                                   replace_pid=pid),
                }[op]())
                assert result.get("error") == "no_such_process", (pid, op, result)
                assert "not a kernel tree this helper runs" in result["message"]
        assert tree_root_of(fake.pid, 0) is None  # the fake "--owner 0" is nobody's tree
        assert account.call(lambda: account.client.trees()) == {"value": []}
        assert not os.path.exists(account.work + "/stolen")
    finally:
        for proc in (ns_init, fake):
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    return out


def _is_namespace_init(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return line.split()[-1] == "1" and len(line.split()) > 2
    except OSError:
        pass
    return False


def test_a_recycled_pid_is_not_the_tree_it_was(helper, client, account, trees) -> None:
    """Attack 3: a user's tree ends and its pid is handed to a root process (the test sets
    ns_last_pid, as a user can cycle pids until they come round). Dumping, signalling or
    killing that pid is refused: the helper knew the tree by pid *and* start time, and the
    tree is gone. The root process is untouched and nothing is dumped."""
    root = account.spawn_holder(Path(account.work), "none")
    assert account.call(lambda: account.client.kill(root)) == {"value": None}
    victim = _root_process_at(root)
    try:
        assert victim.pid == root
        for op, fn in (("dump", lambda: account.client.dump(root, account.work + "/stolen")),
                       ("signal", lambda: account.client.signal(root, signal.SIGTERM)),
                       ("kill", lambda: account.client.kill(root))):
            result = account.call(fn)
            assert result.get("error") == "no_such_process", (op, result)
        assert victim.poll() is None  # alive, unsignalled
        assert not os.path.exists(account.work + "/stolen")
    finally:
        victim.kill()
        victim.wait()


def _root_process_at(pid: int) -> subprocess.Popen:
    """A root process that gets ``pid`` (bounded: a few hundred forks at most)."""
    for _ in range(300):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "600"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"could not get pid {pid} back")


# --- paths: release through a mount namespace of the attacker -----------------------------------


FLIPPER = r"""
import ctypes, os, sys
a, b = sys.argv[1], sys.argv[2]   # a directory and a symlink, swapped in place for ever
libc = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE, AT_FDCWD = 2, -100
while True:
    libc.syscall(316, AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE)
"""


@pytest.mark.skipif(not os.path.exists("/proc/sys/user/max_user_namespaces"),
                    reason="no user namespaces on this kernel")
def test_release_through_a_mount_namespace_and_a_flipping_symlink(helper, account, root_dir):
    """Attack 2: the user's own mount namespace (unshare -Urm) with / bound under their work
    dir, and a component of the released path that is a symlink into /proc/<their pid>/root/...
    (where root's directory shows up inside their work dir): first held still (100 requests,
    each refused), then swapped with a look-alike real directory in a loop (renameat2
    RENAME_EXCHANGE) while 300 more release requests race it. Paths are resolved beneath the work dir with
    openat2 (no symlinks, no magic links, no mount crossings), so root's file and directory
    stay whatever the race does."""
    work = Path(account.work)
    bound = work / f"bound-{secrets.token_hex(3)}"
    bound.mkdir()
    account.own(bound)
    keeper = subprocess.Popen(
        user_argv(account.user, ["unshare", "--user", "--map-root-user", "--mount",
                                 "--propagation", "private", "--kill-child", "sh", "-c",
                                 f"mount --rbind / {bound} && echo bound && exec sleep 600"]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert keeper.stdout.readline().strip() == "bound", "unshare -Urm failed"
    (root_dir / "tree" / "sub").mkdir(parents=True)
    (root_dir / "tree" / "sub" / "file").write_text("root's\n")
    before = {p: snapshot_of(str(root_dir / p)) for p in ("passwd", "tree", "tree/sub/file")}
    inner = [c for c in _children(keeper.pid)] or [keeper.pid]
    through = f"/proc/{inner[-1]}/root{bound}{root_dir}"
    assert as_user(account.user, lambda: os.path.exists(f"{through}/passwd")) == {"value": True}
    tag = secrets.token_hex(3)
    name, other = work / f"a-{tag}", work / f"a-{tag}.swap"
    name.symlink_to(through)
    (other / "tree" / "sub").mkdir(parents=True)  # the directory side looks alike
    for p in (name, other, other / "tree", other / "tree" / "sub"):
        account.own(p)
    script = work / "flipper.py"
    script.write_text(FLIPPER)
    account.own(script)
    outcomes: dict[str, int] = {}

    def release(i: int) -> str:
        # the flipping component is never the last one: it is crossed, not opened
        target = name / ("tree/sub/file", "tree/sub")[i % 2]
        result = account.call(lambda: account.client.release(str(target)))
        assert result.get("error", "ok") in ("ok", "bad_path"), result
        return result.get("error", "ok")

    for i in range(100):  # the symlink held still: refused every time
        assert release(i) == "bad_path"
    flipper = subprocess.Popen(user_argv(account.user, [SYSTEM_PYTHON, str(script), str(name),
                                                        str(other)]))
    try:
        for i in range(300):
            key = release(i)
            outcomes[key] = outcomes.get(key, 0) + 1
    finally:
        flipper.kill()
        flipper.wait()
        keeper.kill()
        keeper.wait()
    assert {p: snapshot_of(str(root_dir / p)) for p in before} == before, outcomes
    print("release race:", outcomes)


# --- denial of service ----------------------------------------------------------------------------


@pytest.fixture
def strict_helper() -> Iterator[HelperDaemon]:
    """A helper of its own with small limits, so the tests reach them with few resources."""
    daemon = HelperDaemon(make_base(), extra_args=(
        "--max-connections-per-user", "8", "--max-ops-per-user", "2",
        "--max-trees-per-user", "3", "--request-timeout", "2", "--criu-timeout", "5"))
    daemon.start()
    yield daemon
    daemon.stop()
    shutil.rmtree(daemon.base, ignore_errors=True)


def _raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(path)
    return s


def test_idle_connections_of_one_user_do_not_lock_out_others(strict_helper, other_account):
    """Attack 5: one user opens 200 connections and sends nothing. They get ``busy`` past their
    own share (8 here); root and the user's own later requests still get answers; a connection
    that trickles a partial request is closed at its deadline with ``request_timeout``."""
    import json

    from infinijup.helper_client import HelperClient

    # The hog runs in a child as the user and keeps its sockets until told to stop.
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # never returns into pytest, whatever happens
        try:
            os.close(r)
            os.close(go_w)
            os.setgroups([])
            os.setgid(other_account.pw_gid)
            os.setuid(other_account.pw_uid)
            held, refused, odd = [], 0, []
            for _ in range(200):
                s = _raw_connect(strict_helper.socket_path)
                # a refused connection is answered "busy" (and closed) whatever it sends; an
                # accepted one answers hello: which one it was never depends on timing
                try:
                    s.sendall(b'{"v":1,"id":1,"op":"hello"}\n')
                except OSError:
                    pass  # refused and closed already: its "busy" is there to read
                data = s.makefile("rb").readline()
                if b'"busy"' in data:
                    refused += 1
                    s.close()
                elif b'"ok":true' in data:
                    held.append(s)
                else:
                    odd.append(data.decode(errors="replace"))
            os.write(w, json.dumps({"held": len(held), "refused": refused, "odd": odd}).encode())
            os.close(w)
            os.read(go_r, 1)  # hold them until the parent has checked
        finally:
            os._exit(0)
    os.close(w)
    os.close(go_r)
    try:
        counts = json.loads(os.read(r, 4096))
        assert counts == {"held": 8, "refused": 192, "odd": []}, counts
        assert HelperClient(strict_helper.socket_path, timeout=30).hello().uid == 0
        # a trickled request: one byte, then nothing
        s = _raw_connect(strict_helper.socket_path)
        s.sendall(b"{")
        reply = json.loads(s.makefile("rb").readline())
        assert reply["error"]["reason"] == "request_timeout", reply
        s.close()
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
        os.close(r)
        os.waitpid(pid, 0)
    other = HelperClient(strict_helper.socket_path, timeout=30)
    assert as_user(other_account, lambda: other.hello().uid) == {"value": other_account.pw_uid}


def test_operations_per_user_are_limited(other_account) -> None:
    """A user runs at most their share of operations at once (2 here): with two of their
    dumps under way (held at a hold point), a third operation gets ``busy``, naming the
    limit; root is served meanwhile; once they finish, the user is served again."""
    import threading

    from infinijup.helper_client import HelperClient

    daemon, holds = _helper_with_holds("--max-ops-per-user", "2")
    try:
        client = HelperClient(daemon.socket_path, timeout=300)
        work = as_user(other_account, client.work_dir)["value"]
        argv = [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"]
        env = {"PATH": "/usr/bin:/bin"}
        roots = [as_user(other_account, lambda i=i: client.spawn(argv, env, work,
                                                                 f"{work}/o{i}.log"))["value"]
                 for i in range(3)]
        (holds / "criu_dump_request").touch()
        results: list[Any] = []
        dumpers = [threading.Thread(target=lambda r=r: results.append(as_user(
            other_account, lambda: client.dump(r, f"{work}/ops-{r}").image_bytes)))
            for r in roots[:2]]
        for t in dumpers:
            t.start()
        staging = Path(daemon.work_dir) / ".staging"
        wait_for(lambda: len([e for e in os.listdir(staging) if e.startswith("dump-")]) == 2,
                 what="both dumps to be under way")  # each holds its slot until it ends
        third = as_user(other_account, lambda: client.dump(roots[2], f"{work}/ops-third"))
        assert third.get("error") == "busy" and "2 operations" in third["message"], third
        assert HelperClient(daemon.socket_path, timeout=30).hello().uid == 0
        (holds / "criu_dump_request").unlink()
        for t in dumpers:
            t.join()
        assert all("value" in r for r in results), results
        assert "value" in as_user(other_account, lambda: client.dump(roots[2],
                                                                     f"{work}/ops-after"))
        for r in roots:
            as_user(other_account, lambda r=r: client.kill(r))
    finally:
        daemon.stop()
        shutil.rmtree(daemon.base, ignore_errors=True)
        shutil.rmtree(holds.parent, ignore_errors=True)


def test_tree_limits_per_user(strict_helper, other_account) -> None:
    """A user cannot start more kernel trees than their share (3 here): the next spawn is
    refused with ``limit_reached``; root is not limited."""
    from infinijup.helper_client import HelperClient

    client = HelperClient(strict_helper.socket_path, timeout=120)
    work = as_user(other_account, client.work_dir)["value"]
    argv = [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"]
    env = {"PATH": "/usr/bin:/bin"}
    started = []
    try:
        for i in range(3):
            got = as_user(other_account, lambda i=i: client.spawn(argv, env, work,
                                                                 f"{work}/t{i}.log"))
            assert "value" in got, got
            started.append(got["value"])
        refused = as_user(other_account, lambda: client.spawn(argv, env, work, f"{work}/t9.log"))
        assert refused.get("error") == "limit_reached", refused
        assert "3" in refused["message"]
        root_work = client.work_dir()
        mine = client.spawn([PYTHON, "-c", "import time; time.sleep(600)"], kernel_env(),
                            root_work, f"{root_work}/r.log")
        client.kill(mine)
    finally:
        for pid in started:
            as_user(other_account, lambda pid=pid: client.kill(pid))


def _helper_with_holds(*args: str) -> tuple[HelperDaemon, Path]:
    """A helper of its own with hold points (infinijup_helper/holds.py) armed by the test."""
    holds = make_base() / "holds"
    holds.mkdir()
    daemon = HelperDaemon(make_base(), extra_args=args,
                          extra_env={"INFINIJUP_HELPER_HOLDS": str(holds)})
    daemon.start()
    return daemon, holds


def _stalled_dump(daemon: HelperDaemon, holds: Path, user: Any) -> tuple[Any, int, str, dict,
                                                                         Any]:
    """The user's tree, and a dump of it whose CRIU the user has stopped (SIGSTOP, as the
    user: it runs with their uid). Waits at the hold point ``criu_dump_request`` (CRIU started,
    nothing asked of it yet), so the stop lands before CRIU does anything, every time.
    Returns (dump thread, tree, work dir, results, client)."""
    import json
    import threading

    from infinijup.helper_client import HelperClient

    client = HelperClient(daemon.socket_path, timeout=600)
    work = as_user(user, client.work_dir)["value"]
    got = as_user(user, lambda: client.spawn(
        [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"], {"PATH": "/usr/bin:/bin"}, work,
        f"{work}/stall-{secrets.token_hex(3)}.log"))
    assert "value" in got, got
    tree = got["value"]
    results: dict[str, Any] = {}
    (holds / "criu_dump_request").touch()

    def dump() -> None:
        results["dump"] = as_user(user, lambda: client.dump(tree, f"{work}/stalled"))

    dumper = threading.Thread(target=dump)
    dumper.start()
    reached = holds / "criu_dump_request.reached"
    wait_for(reached.exists, what="CRIU to start")
    criu = json.loads(reached.read_text())["criu_pid"]
    wait_for(lambda: Path(f"/proc/{criu}/status").read_text().split("Uid:")[1].split()[0]
             == str(user.pw_uid), what="CRIU to run as the user")
    subprocess.run(user_argv(user, ["kill", "-STOP", str(criu)]), check=True)
    results["criu"] = criu
    (holds / "criu_dump_request").unlink()
    return dumper, tree, work, results, client


def test_a_stalled_criu_holds_nobody_else(trees, other_account) -> None:
    """Attack 4: the user's CRIU stalls (here the user stops it with SIGSTOP: it runs as them)
    and stays stalled while another user's snapshot runs to completion (no helper-wide CRIU
    lock left to hold them). Then it is killed, and that dump fails cleanly."""
    from infinijup.helper_client import HelperClient

    daemon, holds = _helper_with_holds()
    try:
        dumper, tree, work, results, other = _stalled_dump(daemon, holds, other_account)
        try:
            root = HelperClient(daemon.socket_path, timeout=300)
            root_work = root.work_dir()
            mine = trees.add(root.spawn([PYTHON, "-c", "import time; time.sleep(600)"],
                                        kernel_env(), root_work, f"{root_work}/nolock.log"))
            done = root.dump(mine, f"{root_work}/while-stalled-{secrets.token_hex(3)}")
            assert done.image_bytes > 0
            assert dumper.is_alive()  # the stalled dump is still stalled: it holds nothing
        finally:
            os.kill(results["criu"], signal.SIGKILL)
            dumper.join()
        assert results["dump"].get("error") == "criu_failed", results["dump"]
        assert not os.path.exists(f"{work}/stalled")
        assert as_user(other_account, lambda: other.status(tree).alive) == {"value": True}
        as_user(other_account, lambda: other.kill(tree))
    finally:
        daemon.stop()
        shutil.rmtree(daemon.base, ignore_errors=True)
        shutil.rmtree(holds.parent, ignore_errors=True)


def test_a_stalled_criu_is_stopped_at_its_deadline(other_account) -> None:
    """The CRIU watchdog: a stalled CRIU that nobody kills is killed at its deadline (5 s plus
    a second per 16 MiB here), and the dump fails with a clear ``criu_failed``; the user's
    tree is left running."""
    daemon, holds = _helper_with_holds("--criu-timeout", "5")
    try:
        dumper, tree, work, results, client = _stalled_dump(daemon, holds, other_account)
        dumper.join()
        assert results["dump"].get("error") == "criu_failed", results["dump"]
        assert "did not finish within" in results["dump"]["message"], results["dump"]
        assert not os.path.exists(f"/proc/{results['criu']}")  # killed
        assert not os.path.exists(f"{work}/stalled")
        assert as_user(other_account, lambda: client.status(tree).alive) == {"value": True}
        as_user(other_account, lambda: client.kill(tree))
    finally:
        daemon.stop()
        shutil.rmtree(daemon.base, ignore_errors=True)
        shutil.rmtree(holds.parent, ignore_errors=True)


def test_criu_runs_as_the_caller() -> None:
    """Documentation by test: the CRIU a non-root dump starts runs with the caller's uid and
    only the capabilities creds.py names (no CAP_DAC_*, no CAP_SETUID)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from infinijup_helper.creds import CRIU_DUMP_CAPS, CRIU_RESTORE_CAPS, RunAs

    argv = RunAs(1234, 1234, (1234, 5), CRIU_RESTORE_CAPS).setpriv_argv("setpriv")
    assert argv[:5] == ["setpriv", "--reuid", "1234", "--regid", "1234"]
    caps = argv[argv.index("--ambient-caps") + 1]
    assert caps.startswith("-all,") and "dac" not in caps and "setuid" not in caps
    assert "sys_resource" not in ",".join(RunAs(1, 1, (), CRIU_DUMP_CAPS).setpriv_argv("s"))


# --- the caller's limits ------------------------------------------------------------------------

LIMITS_USER = "infinijup-sec-limits"  # an account of this test alone: its process count is ours


@pytest.fixture
def limits_account() -> Iterator[Any]:
    from helperkit import ensure_user, remove_user

    user, created = ensure_user(LIMITS_USER)
    yield user
    if created:
        remove_user(user)


def _count_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        try:
            n += pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            continue
    return n


def test_kernels_get_the_callers_resource_limits(helper, limits_account) -> None:
    """Attack 6: a user whose processes are capped (RLIMIT_NPROC) asks the root helper for
    kernels. Each kernel runs with the caller's limits (read from the connecting process), so
    once the user's processes reach the cap the next spawn fails with the reason, instead of
    the helper handing out root's limits."""
    import resource

    from infinijup.helper_client import HelperClient

    client = HelperClient(helper.socket_path, timeout=120)
    work = as_user(limits_account, client.work_dir)["value"]
    argv = [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"]
    env = {"PATH": "/usr/bin:/bin"}
    # The account is this test's: wait until the processes of earlier tests are gone (under
    # load they can still be exiting), so that the cap leaves room for exactly what is meant.
    deadline = time.monotonic() + 120
    while _count_processes(limits_account.pw_uid):
        assert time.monotonic() < deadline, "the test account's earlier processes never ended"
        time.sleep(0.05)
    cap = 5  # this process and room for two trees (init + kernel)

    def spawn_all() -> list[Any]:
        resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
        resource.setrlimit(resource.RLIMIT_NOFILE, (321, 654))
        out = []
        for i in range(6):
            try:
                out.append(client.spawn(argv, env, work, f"{work}/n{i}.log"))
            except Exception as exc:  # noqa: BLE001
                out.append({"error": getattr(exc, "reason", ""), "message": str(exc)})
                break
        return out

    got = as_user(limits_account, spawn_all)["value"]
    roots = [r for r in got if isinstance(r, int)]
    try:
        assert 1 <= len(roots) <= 3, got
        assert got[-1]["error"] == "spawn_failed", got
        assert "process limit (RLIMIT_NPROC" in got[-1]["message"], got
        for root in roots:
            (kernel,) = _children(root)
            limits = Path(f"/proc/{kernel}/limits").read_text()
            assert _limit(limits, "Max processes") == (str(cap), str(cap))
            assert _limit(limits, "Max open files") == ("321", "654")
    finally:
        for root in roots:
            as_user(limits_account, lambda root=root: client.kill(root))


def _processes_of(uid: int) -> list[Any]:
    import psutil

    out = []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] and proc.info["uids"].real == uid and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def _limit(text: str, row: str) -> tuple[str, str]:
    for line in text.splitlines():
        if line.startswith(row + " "):
            soft, hard = line[len(row):].split()[:2]
            return soft, hard
    raise AssertionError(f"no {row!r} in {text}")


# --- page files changed under CRIU ----------------------------------------------------------------


@pytest.fixture
def holding_helper(tmp_path) -> Iterator[tuple[HelperDaemon, Path]]:
    """A helper with hold points (infinijup_helper/holds.py) in a directory of this test."""
    holds = Path(make_base()) / "holds"
    holds.mkdir()
    daemon = HelperDaemon(make_base(), extra_env={"INFINIJUP_HELPER_HOLDS": str(holds)})
    daemon.start()
    yield daemon, holds
    for entry in holds.iterdir():
        entry.unlink()
    daemon.stop()
    shutil.rmtree(daemon.base, ignore_errors=True)
    shutil.rmtree(holds.parent, ignore_errors=True)


def test_a_page_file_truncated_under_criu_stops_that_restore_only(holding_helper, client,
                                                                   other_account, trees):
    """Attack 4: the user restores their own images and truncates a hard-linked page file
    after the helper checked its size, while CRIU runs (CRIU 4.2.1 spins for ever on a short
    page file). The helper watches the linked files while CRIU runs: that restore fails with
    the reason, CRIU is stopped, and the helper keeps serving."""
    from infinijup.helper_client import HelperClient

    helper, holds = holding_helper
    other = HelperClient(helper.socket_path, timeout=300)
    account = Account(helper, other_account, trees)
    root = account.spawn_holder(Path(account.work), "none")
    images = os.path.join(account.work, "truncate-me")
    assert "value" in account.call(lambda: other.dump(root, images).__dict__)
    assert account.call(lambda: other.kill(root)) == {"value": None}
    seal = __import__("json").loads((Path(images) / "infinijup-seal.json").read_text())
    linked = [n for n, v in seal["files"].items() if n.startswith("pages-") and not v["sha256"]]
    pages = max((Path(images) / n for n in linked), key=lambda p: p.stat().st_size)
    before = {p.pid for p in _processes_of(other_account.pw_uid)}
    (holds / "criu_restore_request").touch()  # CRIU started, nothing sent to it yet

    def restore() -> dict[str, Any]:
        return account.call(lambda: other.restore(images))

    import threading

    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(restore()))
    worker.start()
    wait_for(lambda: (holds / "criu_restore_request.reached").exists(), what="CRIU to start")
    criu_pid = __import__("json").loads(
        (holds / "criu_restore_request.reached").read_text())["criu_pid"]
    # one page short: the shape on which CRIU spins for ever
    short = pages.stat().st_size - 4096
    subprocess.run(user_argv(other_account, ["truncate", "-s", str(short), str(pages)]),
                   check=True)
    (holds / "criu_restore_request").unlink()
    worker.join()
    assert result.get("error") == "permission_denied", result
    assert f"{pages.name} changed while CRIU was reading it" in result["message"], result
    # the half-restored tree went with CRIU (its tasks would otherwise spin for ever)
    wait_for(lambda: {p.pid for p in _processes_of(other_account.pw_uid)} <= before,
             what="the aborted restore's tasks to be gone")
    assert not os.path.exists(f"/proc/{criu_pid}") or \
        Path(f"/proc/{criu_pid}/stat").read_text().split(") ")[1][0] == "Z"
    assert HelperClient(helper.socket_path, timeout=30).hello().uid == 0


def _as_user_in_cgroup(user: Any, procs: str, fn: Any) -> dict[str, Any]:
    """``as_user``, from a process that first joined the cgroup of ``procs``."""
    import json

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            with open(procs, "w") as f:
                f.write("0")
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            try:
                out: Any = {"value": fn()}
            except Exception as exc:  # noqa: BLE001
                out = {"error": getattr(exc, "reason", None) or type(exc).__name__,
                       "message": str(exc)}
            os.write(write_fd, json.dumps(out, default=repr).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"{pid} has no cgroup v2 line")


def test_kernels_join_the_callers_cgroup(helper, other_account, trees) -> None:
    """Attack 6, the cgroup half: a kernel started (and restored) for a user runs in the
    cgroup of the process that asked, not in the root helper's, so the limits that hold the
    user hold their kernels."""
    from infinijup.helper_client import HelperClient
    from infinijup_helper.cgroups import unified_mount

    mount = unified_mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy on this machine")
    group = Path(mount) / f"ijsec-{secrets.token_hex(4)}"
    group.mkdir()
    procs = str(group / "cgroup.procs")
    client = HelperClient(helper.socket_path, timeout=120)
    roots: list[int] = []
    try:
        work = as_user(other_account, client.work_dir)["value"]
        got = _as_user_in_cgroup(other_account, procs, lambda: client.spawn(
            [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"], {"PATH": "/usr/bin:/bin"},
            work, f"{work}/cg.log"))
        assert "value" in got, got
        roots.append(trees.add(got["value"]))
        (kernel,) = _children(roots[0])
        assert _cgroup_of(roots[0]) == _cgroup_of(kernel) == "/" + group.name
        assert _cgroup_of(helper.proc.pid) != "/" + group.name
        images = f"{work}/cg-images-{secrets.token_hex(3)}"
        assert "value" in as_user(other_account, lambda: client.dump(roots[0], images).__dict__)
        restored = _as_user_in_cgroup(other_account, procs, lambda: client.restore(
            images, replace_pid=roots[0]).pid)
        assert "value" in restored, restored
        roots.append(trees.add(restored["value"]))
        (kernel,) = _children(roots[1])
        assert _cgroup_of(roots[1]) == _cgroup_of(kernel) == "/" + group.name
    finally:
        for root in roots:
            as_user(other_account, lambda root=root: client.kill(root))
        wait_for(lambda: not (group / "cgroup.procs").read_text().strip(),
                 what="the cgroup to empty")
        group.rmdir()


def test_a_restarted_helper_adopts_only_its_own_trees(other_account) -> None:
    """Attack 7, adoption: after a helper crash, the next helper knows the trees from its
    registry file (pid and start time, written by root only), not from command lines. A live
    tree is adopted and still obeys its owner; a tree that ended while no helper ran and whose
    pid a root process took meanwhile is not adopted (its start time differs)."""
    import json

    from infinijup.helper_client import HelperClient

    base = make_base()
    first = HelperDaemon(base)
    first.start()
    client = HelperClient(first.socket_path, timeout=120)
    work = as_user(other_account, client.work_dir)["value"]
    argv = [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"]
    env = {"PATH": "/usr/bin:/bin"}
    kept = as_user(other_account, lambda: client.spawn(argv, env, work, f"{work}/kept.log"))
    gone = as_user(other_account, lambda: client.spawn(argv, env, work, f"{work}/gone.log"))
    kept, gone = kept["value"], gone["value"]
    recorded = json.loads(Path(first.socket_path + ".trees.json").read_text())["trees"]
    assert {t["pid"] for t in recorded} == {kept, gone}
    first.stop(signal.SIGKILL)  # a crash: kernels run on
    impostor = None
    second = HelperDaemon(base)
    try:
        os.kill(gone, signal.SIGKILL)  # its tree ends while no helper runs ...
        wait_for(lambda: not os.path.exists(f"/proc/{gone}") or
                 Path(f"/proc/{gone}/stat").read_text().split(") ")[1][0] == "Z",
                 what="the tree to end")
        _reap_orphan(gone)
        impostor = _root_process_at(gone)  # ... and a root process gets its pid
        second.start()
        assert as_user(other_account, lambda: client.trees()) == {"value": [kept]}
        for fn in (lambda: client.dump(gone, f"{work}/stolen"),
                   lambda: client.signal(gone, signal.SIGTERM)):
            result = as_user(other_account, fn)
            assert result.get("error") == "no_such_process", result
        assert impostor.poll() is None and not os.path.exists(f"{work}/stolen")
        # the adopted tree is still its owner's alone
        assert as_user(other_account, lambda: client.status(kept).alive) == {"value": True}
        assert as_user(other_account, lambda: client.dump(kept, f"{work}/adopted").image_bytes)
        assert HelperClient(second.socket_path, timeout=60).kill(kept) is None  # root may
    finally:
        if impostor is not None:
            impostor.kill()
            impostor.wait()
        for pid in (kept, gone):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        second.stop()
        shutil.rmtree(base, ignore_errors=True)


def _reap_orphan(pid: int) -> None:
    """A tree whose helper died was reparented to init (or to us, a subreaper): wait until
    its pid is free."""
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), what=f"{pid} to be reaped")


@pytest.mark.timeout(900)  # a hang guard for a busy 2-core machine
def test_dumps_racing_the_trees_death(helper, other_account) -> None:
    """Attack 3's race, as the user can run it: they kill their own tree's init (it runs as
    them) while the helper dumps it, 60 times, at a different point each time. Whatever CRIU
    meets, the dump either succeeds with images of that tree only (the caller's credentials)
    or fails cleanly; no image dir is left half-made, the registry forgets the dead trees, and
    nothing of the user's is left running."""
    import threading

    import pycriu

    from infinijup.helper_client import HelperClient

    client = HelperClient(helper.socket_path, timeout=300)
    work = as_user(other_account, client.work_dir)["value"]
    argv = [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"]
    env = {"PATH": "/usr/bin:/bin"}
    outcomes: dict[str, int] = {}
    roots: list[int] = []
    for i in range(60):
        got = as_user(other_account, lambda i=i: client.spawn(argv, env, work, f"{work}/r{i}.log"))
        root = got["value"]
        roots.append(root)
        images = f"{work}/race-{i}"
        result: dict[str, Any] = {}
        dumper = threading.Thread(target=lambda im=images, r=root, out=result: out.update(
            as_user(other_account, lambda: client.dump(r, im).image_bytes)))
        dumper.start()
        spin = (i % 20) * 30000  # a different point of the dump each time (outcome-neutral)
        as_user(other_account, lambda r=root, n=spin: (sum(range(n)), os.kill(r, 9)))
        dumper.join()
        outcome = result.get("error", "ok")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        assert outcome in ("ok", "no_such_process", "criu_failed"), result
        if outcome == "ok":
            for core in Path(images).glob("core-*.img"):
                creds = pycriu.images.load(open(core, "rb"))["entries"][0]["thread_core"]["creds"]
                assert creds["uid"] == creds["euid"] == other_account.pw_uid
            shutil.rmtree(images)
        else:
            assert not os.path.exists(images)
    wait_for(lambda: not set(as_user(other_account, client.trees)["value"]) & set(roots),
             what="the registry to forget the dead trees")
    wait_for(lambda: not {p.pid for p in _processes_of(other_account.pw_uid)} & set(roots),
             what="nothing of them left running")
    print("dump vs death:", outcomes)
    # A kill can land while CRIU's parasite has its mount point in the inits' cwd; the user's
    # next dump must still work (test_a_dump_clears_what_a_killed_init_left_of_criu)
    got = as_user(other_account, lambda: client.spawn(argv, env, work, f"{work}/after.log"))
    after = got["value"]
    dumped = as_user(other_account, lambda: client.dump(after, f"{work}/after").__dict__)
    as_user(other_account, lambda: client.kill(after))
    assert "value" in dumped, json.dumps(dumped, indent=1)
    shutil.rmtree(f"{work}/after")


def test_a_dump_clears_what_a_killed_init_left_of_criu(helper, account) -> None:
    """Dumping a PID namespace's init, CRIU's parasite makes ``proc.crtools`` in the init's
    cwd (shared by the user's inits), mounts a proc there, then detaches and removes it. An
    init its owner kills in between leaves the directory behind: a loop of such kills (the
    race above, with kills spread over the whole dump) left it once in 187 tries, and every
    later dump of that user's trees failed ("Can't create a directory (-17)"). What such a kill
    leaves is made here directly: the directory as the init made it (the user's, 0700, so
    they can put files in it), and a proc still mounted on it. The next dump removes both."""
    root = account.spawn_holder(Path(account.work), "plain")
    with open(f"/proc/{root}/status") as f:
        if len([ln for ln in f if ln.startswith("NSpid:")][0].split()) != 3:
            pytest.skip("the helper runs trees without PID namespaces here (no parasite mount)")
    cwd = os.readlink(f"/proc/{root}/cwd")
    stale = os.path.join(cwd, "proc.crtools")
    os.mkdir(stale, 0o700)
    account.own(stale)
    junk = account.call(lambda: Path(stale, "junk").write_text("theirs"))
    assert junk == {"value": 6}, junk
    subprocess.run(["mount", "-t", "proc", "proc", stale], check=True)
    try:
        images = os.path.join(account.work, f"after-kill-{secrets.token_hex(3)}")
        dumped = account.call(lambda: account.client.dump(root, images).__dict__)
        assert "value" in dumped, json.dumps(dumped, indent=1)
        assert not os.path.ismount(stale) and not os.path.lexists(stale)
        assert "removed a stale proc.crtools" in helper.log()
        shutil.rmtree(images)
    finally:
        if os.path.ismount(stale):
            subprocess.run(["umount", "-l", stale], check=False)


SETUID_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.argv[1], "600"])
print("ready", flush=True)
time.sleep(600)
"""


def test_a_setuid_member_of_a_users_tree_is_never_dumped_or_locked_for_them(account):
    """Item 7: a user's tree can hold a process that runs as root (a setuid program the user
    started). The helper never dumps it for them (its memory is root's) and its CUDA stage
    never locks or checkpoints it (cuda_stage.tree_pids with the caller as owner): the dump is
    refused with the reason, and the setuid process runs on, untouched."""
    from infinijup_helper.cuda_stage import tree_pids
    from infinijup_helper.proc import read_proc, tree_members

    shelf = Path(f"/var/tmp/ijsuid-{secrets.token_hex(4)}")  # root's, readable by all
    shelf.mkdir(mode=0o755)
    os.chmod(shelf, 0o755)
    suid = shelf / "sleep-as-root"
    shutil.copy("/bin/sleep", suid)
    os.chmod(suid, 0o4755)
    try:
        script = Path(account.work) / "setuid-parent.py"
        script.write_text(SETUID_PARENT)
        account.own(script)
        log = os.path.join(account.work, "setuid-parent.log")
        got = account.call(lambda: account.client.spawn(
            [SYSTEM_PYTHON, str(script), str(suid)], {"PATH": "/usr/bin:/bin"}, account.work, log))
        assert "value" in got, got
        root = account.trees.add(got["value"])
        wait_for(lambda: "ready" in (Path(log).read_text() if os.path.exists(log) else ""),
                 what="the setuid child to start")
        as_root = [p for p in tree_members(root)[1:]
                   if (info := read_proc(p)) is not None and info.uids[1] == 0]
        assert len(as_root) == 1, [read_proc(p) for p in tree_members(root)]
        (victim,) = as_root
        owner = account.user.pw_uid
        assert victim in tree_pids(root) and victim not in tree_pids(root, owner)
        assert set(tree_pids(root, owner)) == set(tree_members(root)) - {victim}

        images = os.path.join(account.work, "images-setuid")
        refused = account.call(lambda: account.client.dump(root, images).__dict__)
        assert refused.get("error") == "permission_denied", refused
        assert f"process {victim}" in refused["message"], refused
        state = read_proc(victim)
        assert state is not None and state.uids[1] == 0
        with open(f"/proc/{victim}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] in "SR", "the setuid process was stopped"
        assert account.call(lambda: account.client.kill(root)) == {"value": None}
    finally:
        shutil.rmtree(shelf, ignore_errors=True)
