"""Launching a kernel tree in a new PID namespace: nsinit as root, the kernel as the caller.

Two halves live here:

* :func:`spawn_tree`, called in the helper, runs this very file as a short-lived *launcher*
  process (``python -I spawn.py`` with a JSON spec on stdin). The helper is multithreaded, and
  forking it directly would risk a child that deadlocks on a lock another thread held;
  ``subprocess`` forks in C and execs at once, so the launcher starts single-threaded and clean.
* :func:`launcher_main`, the launcher: ``unshare(CLONE_NEWPID)`` and fork; the child, PID 1 of
  the new namespace, execs ``nsinit.py --owner UID`` (still root: see nsinit.py for why) with a
  clean environment, stdio on /dev/null and cwd a root-only directory, and nsinit forks the
  kernel, which drops to the caller's groups, gid and uid before it opens the log, enters
  ``cwd`` and execs ARGV. The launcher waits until that exec succeeded or failed, prints the
  init's pid or the failure, and exits; the init is reparented to the helper (a subreaper).

PR_SET_PDEATHSIG is deliberately not set: a helper restart must not take kernels with it.
This module imports only the standard library, so it runs in isolated mode (``-I``).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

CLONE_NEWPID = 0x20000000
NSINIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nsinit.py")


@dataclass(frozen=True)
class SpawnSpec:
    """Everything the launcher needs, already validated and confined by the helper."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str
    log_path: str
    uid: int
    gid: int
    groups: Sequence[int]
    python: str
    nsinit_cwd: str
    pid_namespace: bool = True


class SpawnFailed(Exception):
    """The tree could not be started; the message says which step failed and why."""


def spawn_tree(spec: SpawnSpec, timeout: float = 30.0) -> int:
    """Start a new PID namespace: nsinit (root) as its PID 1, ARGV as ``spec.uid`` below it.

    Returns the init's host pid once ARGV has been executed; raises :class:`SpawnFailed`
    naming the step that failed otherwise (nothing is left running then).
    """
    try:
        done = subprocess.run(
            [spec.python, "-I", os.path.abspath(__file__)],
            input=json.dumps(asdict(spec)).encode(),
            capture_output=True,
            env={},
            cwd="/",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SpawnFailed("the namespace launcher did not answer in time") from None
    try:
        answer = json.loads(done.stdout.decode() or "null")
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        err = done.stderr.decode(errors="replace").strip()[-2000:]
        raise SpawnFailed(f"the namespace launcher failed (exit {done.returncode}): {err}")
    if "error" in answer:
        raise SpawnFailed(str(answer["error"]))
    return int(answer["pid"])


# ---------------------------------------------------------------------------------------------
# The launcher process (runs as root, single-threaded)

SPEC_FD = 3  # as nsinit.py expects them
ERROR_FD = 4


def _exec_nsinit(spec: dict, spec_r: int, error_w: int) -> None:
    """In the namespace's PID 1: arrange fds 0-4 and become nsinit (root, clean env)."""
    os.setsid()
    os.chdir(spec["nsinit_cwd"])
    high_spec = fcntl.fcntl(spec_r, fcntl.F_DUPFD, 10)
    high_error = fcntl.fcntl(error_w, fcntl.F_DUPFD, 10)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.dup2(high_spec, SPEC_FD)
    os.dup2(high_error, ERROR_FD)
    os.closerange(ERROR_FD + 1, os.sysconf("SC_OPEN_MAX"))
    python = spec["python"]
    os.execve(python, [python, "-I", NSINIT, "--owner", str(spec["uid"])], {})


def launcher_main() -> int:
    spec = json.load(sys.stdin)
    libc = ctypes.CDLL(None, use_errno=True)
    if spec.get("pid_namespace", True) and libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        print(json.dumps({"error": f"unshare(CLONE_NEWPID): {os.strerror(err)}"}))
        return 1
    spec_r, spec_w = os.pipe2(os.O_CLOEXEC)
    errors_r, errors_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(spec_w)
            os.close(errors_r)
            _exec_nsinit(spec, spec_r, errors_w)
        except BaseException as exc:  # report anything
            os.write(errors_w, f"start nsinit: {exc}".encode(errors="replace")[:4000])
        os._exit(127)
    os.close(spec_r)
    os.close(errors_w)
    data = memoryview(json.dumps({k: spec[k] for k in SPEC_KEYS}).encode())
    try:
        while data:
            data = data[os.write(spec_w, data) :]
    except BrokenPipeError:
        pass  # nsinit died before reading; its reason arrives on the error pipe
    os.close(spec_w)
    failure = b""
    while chunk := os.read(errors_r, 4096):  # EOF once the kernel's exec succeeded
        failure += chunk
    if failure:
        os.waitpid(pid, 0)
        print(json.dumps({"error": failure.decode(errors="replace")}))
        return 1
    print(json.dumps({"pid": pid}))
    return 0


SPEC_KEYS = ("argv", "env", "cwd", "log_path", "uid", "gid", "groups")


if __name__ == "__main__":
    sys.exit(launcher_main())
