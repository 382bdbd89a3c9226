"""A user's own images as hostile input: mutated, re-sealed, restored as that user.

The seal keeps a user from handing the helper images the helper did not dump. This fuzzer
assumes the seal is beaten (it re-seals each mutation with the helper's key, as only a test can)
and checks what is left standing behind it: the credential checks, and CRIU restoring as the
user with no capability that opens anything for them. Real images of a real kernel-shaped tree
of the second account (a file held read-write, a log, a listening unix socket, its cwd) are
mutated: file names and paths (to root's files and directories, the helper's socket), modes and
open flags, credentials, the page maps, the process tree, random bytes. After every restore:
no process of the user holds a root-owned file open for writing or sits in a root-only
directory, no process of the restored tree runs with other credentials, root's files and the
helper's socket are unchanged, and the helper answers. Bounded by a count of mutations; each
restore runs under the helper's CRIU watchdog, so none can hang.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helperkit import (
    HOLDER,
    SYSTEM_PYTHON,
    HelperDaemon,
    as_user,
    make_base,
    needs_root_and_criu,
    snapshot_of,
    wait_for,
)

pytestmark = needs_root_and_criu

MUTATIONS_PER_KIND = int(os.environ.get("INFINIJUP_IMAGE_FUZZ_ROUNDS", "3"))
O_WRONLY, O_RDWR, O_APPEND, O_CREAT, O_TRUNC = 0o1, 0o2, 0o2000, 0o100, 0o1000
ALLOWED = {"ok", "criu_failed", "permission_denied", "bad_request", "missing_files"}


@pytest.fixture(scope="module")
def fuzz_helper() -> Iterator[HelperDaemon]:
    daemon = HelperDaemon(make_base(), extra_args=("--criu-timeout", "60"))
    daemon.start()
    yield daemon
    daemon.stop()
    shutil.rmtree(daemon.base, ignore_errors=True)


@pytest.fixture(scope="module")
def root_targets() -> Iterator[dict[str, Path]]:
    base = Path(f"/var/tmp/ijsec-fuzz-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    private = base / "private"
    private.mkdir(mode=0o700)
    (private / "secret").write_text("root's secret\n")
    yield {"dir": base, "private": private}
    shutil.rmtree(base, ignore_errors=True)


class Subject:
    """The second account's tree and its real, sealed images."""

    def __init__(self, helper: HelperDaemon, user: Any) -> None:
        from infinijup.helper_client import HelperClient

        self.helper = helper
        self.user = user
        self.client = HelperClient(helper.socket_path, timeout=300)
        self.work = Path(as_user(user, self.client.work_dir)["value"])
        d = self.work / "d"
        d.mkdir()
        (d / "passwd").write_text("x" * 128)
        script = self.work / "holder.py"
        script.write_text(HOLDER.replace('elif mode == "socket":', 'if mode in ("socket", "all"):')
                          .replace('if mode == "file":', 'if mode in ("file", "all"):'))
        for p in (d, d / "passwd", script):
            os.lchown(p, user.pw_uid, user.pw_gid)
        log = self.work / "holder.log"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.work)}
        got = as_user(user, lambda: self.client.spawn([SYSTEM_PYTHON, str(script), str(d), "all"],
                                                      env, str(d), str(log)))
        assert "value" in got, got
        root = got["value"]
        wait_for(lambda: log.exists() and "ready" in log.read_text(), what="the holder")
        self.images = self.work / "original"
        dumped = as_user(user, lambda: self.client.dump(root, str(self.images)).__dict__)
        assert "value" in dumped, dumped
        assert as_user(user, lambda: self.client.kill(root)) == {"value": None}
        seal = json.loads((self.images / "infinijup-seal.json").read_text())
        self.size_only = {n for n, v in seal["files"].items() if v["sha256"] is None}

    def mutated_copy(self, mutate: Callable[[Path], None]) -> Path:
        """A copy of the images, mutated, re-sealed with the helper's key, the user's."""
        from infinijup_helper.seal import SEAL_NAME, Sealer

        target = self.work / f"m-{secrets.token_hex(4)}"
        shutil.copytree(self.images, target)
        (target / SEAL_NAME).unlink()
        mutate(target)
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        try:
            Sealer(os.path.join(self.helper.work_dir, ".seal-key")).seal(
                fd, self.user.pw_uid, self.size_only & set(os.listdir(target)))
        finally:
            os.close(fd)
        for p in [target, *target.iterdir()]:
            os.lchown(p, self.user.pw_uid, self.user.pw_gid)
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
        return target


@pytest.fixture(scope="module")
def subject(fuzz_helper, other_account) -> Subject:
    return Subject(fuzz_helper, other_account)


# --- mutations -------------------------------------------------------------------------------------


def _load(d: Path, name: str) -> dict:
    import pycriu

    with open(d / name, "rb") as f:
        return pycriu.images.load(f)


def _store(d: Path, name: str, image: dict) -> None:
    import pycriu

    with open(d / name, "wb") as f:
        pycriu.images.dump(image, f)


def _regs(files: dict) -> list[dict]:
    return [e["reg"] for e in files["entries"] if e["type"] == "REG"]


def mutations(targets: dict[str, Path], helper_socket: str) -> dict[str, Callable]:
    root_file = targets["dir"] / "rootfile"
    private = targets["private"]

    def retarget_reg(pick: Callable[[dict], bool], path: str, flags: int | None = None,
                     match_size: bool = False) -> Callable[[Path, random.Random], None]:
        def mutate(d: Path, rng: random.Random) -> None:
            files = _load(d, "files.img")
            candidates = [r for r in _regs(files) if pick(r)] or _regs(files)
            reg = rng.choice(candidates)
            if match_size and "size" in reg:  # root's file made to pass CRIU's size check
                Path(path).write_bytes(b"r" * reg["size"])
                os.chmod(path, stat.S_IMODE(reg.get("mode", 0o100644)))
            reg["name"] = path
            if flags is not None:
                reg["flags"] = flags
            _store(d, "files.img", files)
        return mutate

    def in_work(r: dict) -> bool:
        return "/work/" in r.get("name", "")

    def socket_to(path: str) -> Callable[[Path, random.Random], None]:
        def mutate(d: Path, rng: random.Random) -> None:
            files = _load(d, "files.img")
            for e in files["entries"]:
                if e["type"] == "UNIXSK" and e["usk"].get("name"):
                    e["usk"]["name"] = path + "=00"
            _store(d, "files.img", files)
        return mutate

    def creds(change: Callable[[dict, random.Random], None]) -> Callable:
        def mutate(d: Path, rng: random.Random) -> None:
            name = rng.choice(sorted(n for n in os.listdir(d) if n.startswith("core-")))
            core = _load(d, name)
            change(core["entries"][0]["thread_core"]["creds"], rng)
            _store(d, name, core)
        return mutate

    def pagemap(change: Callable[[list, random.Random], None]) -> Callable:
        def mutate(d: Path, rng: random.Random) -> None:
            name = rng.choice(sorted(n for n in os.listdir(d) if n.startswith("pagemap-")))
            image = _load(d, name)
            if len(image["entries"]) > 1:
                change(image["entries"], rng)
            _store(d, name, image)
        return mutate

    def flip_bytes(d: Path, rng: random.Random) -> None:
        name = rng.choice(sorted(n for n in os.listdir(d)
                                 if n.endswith(".img") and not n.startswith("pages-")))
        data = bytearray((d / name).read_bytes())
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] = rng.randrange(256)
        (d / name).write_bytes(bytes(data))

    def exe_to_root_file(d: Path, rng: random.Random) -> None:
        files = _load(d, "files.img")
        Path(root_file).write_bytes(b"#!/bin/sh\n")
        new_id = max(e["id"] for e in files["entries"]) + 1
        files["entries"].append({"type": "REG", "id": new_id, "reg": {
            "id": new_id, "flags": 0, "pos": 0, "name": str(root_file), "mode": 0o100644,
            "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0}}})
        _store(d, "files.img", files)
        name = rng.choice(sorted(n for n in os.listdir(d) if n.startswith("mm-")))
        mm = _load(d, name)
        mm["entries"][0]["exe_file_id"] = new_id
        _store(d, name, mm)

    def cwd_to(path: Path) -> Callable:
        def mutate(d: Path, rng: random.Random) -> None:
            files = _load(d, "files.img")
            for reg in _regs(files):
                if stat.S_ISDIR(reg.get("mode", 0)) and in_work(reg):
                    reg["name"] = str(path)
                    reg["mode"] = os.stat(path).st_mode
            _store(d, "files.img", files)
        return mutate

    return {
        "held file -> root's file (same size and mode, read-write)":
            retarget_reg(in_work, str(root_file), O_RDWR, match_size=True),
        "held file -> /etc/shadow": retarget_reg(in_work, "/etc/shadow"),
        "log -> root's file, appending": retarget_reg(in_work, str(root_file),
                                                      O_WRONLY | O_APPEND, match_size=True),
        "mapped library opened read-write": retarget_reg(
            lambda r: r.get("name", "").startswith("/usr/"), "/usr/bin/python3", O_RDWR),
        "any file -> a file in root's private dir":
            retarget_reg(lambda r: True, str(private / "secret"), O_RDWR),
        "open flags: create and truncate": retarget_reg(
            in_work, str(targets["dir"] / "created"), O_WRONLY | O_CREAT | O_TRUNC),
        "cwd -> root's private dir": cwd_to(private),
        "unix socket -> the helper's socket": socket_to(helper_socket),
        "unix socket -> root's dir": socket_to(str(targets["dir"] / "planted.sock")),
        "exe -> root's file": exe_to_root_file,
        "creds: uid 0": creds(lambda c, r: c.update({"uid": 0, "euid": 0, "suid": 0,
                                                     "fsuid": 0})),
        "creds: fsuid 0": creds(lambda c, r: c.update({"fsuid": 0})),
        "creds: all capabilities": creds(lambda c, r: c.update(
            {k: [0xFFFFFFFF, 0x1FF] for k in ("cap_inh", "cap_prm", "cap_eff", "cap_amb")})),
        "creds: group 0": creds(lambda c, r: c.update({"groups": [*c.get("groups", []), 0]})),
        "creds: gid 0": creds(lambda c, r: c.update({"gid": 0, "egid": 0, "sgid": 0})),
        "page map: one page more": pagemap(lambda e, r: r.choice(e[1:]).update(
            nr_pages=r.choice(e[1:])["nr_pages"] + 1)),
        "page map: moved": pagemap(lambda e, r: r.choice(e[1:]).update(
            vaddr=r.choice(e[1:])["vaddr"] + 4096 * r.randint(1, 64))),
        "page map: flags": pagemap(lambda e, r: r.choice(e[1:]).update(flags=r.randrange(16))),
        "random bytes": flip_bytes,
    }


# --- the invariants --------------------------------------------------------------------------------


def _fd_flags(pid: str, fd: str) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


def violations(uid: int) -> list[str]:
    """Processes of ``uid`` holding a root-owned regular file open for writing, or sitting in
    a directory that is not theirs and not open to them."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and \
                        _fd_flags(pid, fd) & (O_WRONLY | O_RDWR):
                    found.append(f"{pid} fd {fd} -> {os.readlink(f'/proc/{pid}/fd/{fd}')}")
            cwd = os.stat(f"/proc/{pid}/cwd")
            if cwd.st_uid != uid and not cwd.st_mode & 0o001:
                found.append(f"{pid} cwd {os.readlink(f'/proc/{pid}/cwd')}")
        except OSError:
            continue
    return found


def tree_creds_problems(root: int, uid: int) -> list[str]:
    problems = []
    queue = [root]
    while queue:
        pid = queue.pop()
        try:
            status = dict(line.split(":\t", 1) for line in
                          Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
            for tid in os.listdir(f"/proc/{pid}/task"):
                queue += [int(x) for x in
                          Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
        if set(status["Uid"].split()) != {str(uid)}:
            problems.append(f"{pid} runs as {status['Uid']}")
        allowed = ((1 << 21) | (1 << 6)) if pid == root else 0
        for key in ("CapEff", "CapPrm", "CapInh", "CapAmb"):
            if int(status[key], 16) & ~allowed:
                problems.append(f"{pid} {key} {status[key]}")
    return problems


def test_mutated_images_restored_as_their_user_reach_nothing(fuzz_helper, subject,
                                                             root_targets) -> None:
    from infinijup.helper_client import HelperClient

    rng = random.Random(int(os.environ.get("INFINIJUP_IMAGE_FUZZ_SEED", "10")))
    watched = [fuzz_helper.socket_path, "/etc/shadow", "/etc/passwd", "/usr/bin/python3",
               str(root_targets["private"] / "secret")]
    before = {p: snapshot_of(p) for p in watched}
    listing = sorted(os.listdir(root_targets["dir"]))
    outcomes: dict[str, dict[str, int]] = {}
    for kind, mutate in mutations(root_targets, fuzz_helper.socket_path).items():
        for _ in range(MUTATIONS_PER_KIND):
            images = subject.mutated_copy(lambda d, m=mutate: m(d, rng))
            result = as_user(subject.user, lambda im=images: subject.client.restore(str(im)).pid)
            outcome = result.get("error", "ok")
            outcomes.setdefault(kind, {}).setdefault(outcome, 0)
            outcomes[kind][outcome] += 1
            assert outcome in ALLOWED, (kind, result)
            if outcome == "ok":
                root = result["value"]
                assert tree_creds_problems(root, subject.user.pw_uid) == [], (kind, root)
            assert violations(subject.user.pw_uid) == [], kind
            if outcome == "ok":
                assert as_user(subject.user, lambda r=root: subject.client.kill(r)) == \
                    {"value": None}
            assert {p: snapshot_of(p) for p in watched} == before, kind
            created = set(os.listdir(root_targets["dir"])) - set(listing) - {"rootfile"}
            assert not created, (kind, created)
            assert HelperClient(fuzz_helper.socket_path, timeout=30).hello().uid == 0
            shutil.rmtree(images)
    print(json.dumps(outcomes, indent=1))
    # The dangerous mutations were refused, not merely harmless by luck.
    for kind in ("held file -> root's file (same size and mode, read-write)",
                 "unix socket -> the helper's socket", "cwd -> root's private dir",
                 "creds: uid 0", "creds: all capabilities"):
        assert "ok" not in outcomes[kind], (kind, outcomes[kind])
