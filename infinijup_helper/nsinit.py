"""PID 1 of a kernel's PID namespace: ``python -I nsinit.py --owner UID``.

Why a separate init at all: CRIU dumps and restores a whole PID namespace by its init, and an
init must reap orphans (or they pile up as zombies) and must pass on the signals Jupyter sends
(SIGINT is "interrupt the kernel"). The kernel itself can then stay an ordinary child.

Why it runs as root while the kernel runs as the caller: to dump a PID namespace, CRIU's
parasite code, running *with the init's credentials*, mounts a /proc for that namespace, which
needs CAP_SYS_ADMIN ("can't dump unprivileged task whose /proc doesn't belong to it"). So this
process keeps root and drops to the caller only in the child it forks for the kernel. Its
command line carries ``--owner UID``: only root can start a root process, so that marker is
how the helper knows whose tree this is (see proc.py), before and after a restore.

Started by the helper's launcher with a clean environment, cwd a root-only directory, stdio on
/dev/null, the spawn spec (JSON: argv, env, cwd, log_path, uid, gid, groups) readable on fd 3,
and fd 4 open for reporting a failure to start the kernel (EOF there means the exec worked).
Runs by path in isolated mode (``-I``), so it imports only the standard library.
"""

from __future__ import annotations

import json
import os
import signal
import sys

SPEC_FD = 3
ERROR_FD = 4
OWNER_FLAG = "--owner"
KERNEL_UMASK = 0o022
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGQUIT,
)
# Dispositions Python changes at startup that the kernel must not inherit through exec.
_RESET_TO_DEFAULT = (signal.SIGPIPE, signal.SIGXFSZ, *FORWARDED)


def _read_spec() -> dict:
    chunks = []
    while chunk := os.read(SPEC_FD, 1 << 16):
        chunks.append(chunk)
    os.close(SPEC_FD)
    return json.loads(b"".join(chunks))


def _become_caller_and_exec(spec: dict) -> None:
    """In the kernel's process: drop to the caller, then touch the caller's files as them."""
    step = "reset signals"
    try:
        for sig in _RESET_TO_DEFAULT:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        step = "setgroups"
        os.setgroups(spec["groups"])
        step = "setgid"
        os.setresgid(spec["gid"], spec["gid"], spec["gid"])
        step = "setuid"
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        os.umask(KERNEL_UMASK)
        step = f"open log {spec['log_path']}"
        log = os.open(
            spec["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        step = f"chdir {spec['cwd']}"
        os.chdir(spec["cwd"])
        step = f"exec {spec['argv'][0]}"
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as exc:
        os.write(ERROR_FD, f"{step}: {exc.strerror}".encode(errors="replace"))
    except BaseException as exc:  # never run on as root
        os.write(ERROR_FD, f"{step}: {exc}".encode(errors="replace"))
    os._exit(127)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != OWNER_FLAG or not argv[1].isdigit():
        os.write(2, b"usage: nsinit.py --owner UID  (spec on fd 3; started by infinijup_helper)\n")
        return 2
    spec = _read_spec()
    if int(argv[1]) != spec["uid"]:
        os.write(ERROR_FD, b"nsinit: --owner does not match the spec's uid")
        return 2
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader
    if os.getpid() != 1:
        # No PID namespace (see spawn.py): orphans of the kernel's subprocesses come to us
        # rather than leaving the tree, so CRIU still dumps them with it.
        import ctypes

        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = 0

    def forward(signum: int, _frame: object) -> None:
        if child:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    # Handlers before the fork, so a signal that arrives in between is not lost to SIG_DFL
    # (which, for a namespace init, means ignored).
    for sig in FORWARDED:
        signal.signal(sig, forward)
    os.set_inheritable(ERROR_FD, False)  # closed by the kernel's exec: EOF means success
    child = os.fork()
    if child == 0:
        _become_caller_and_exec(spec)
    os.close(ERROR_FD)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0  # cannot happen while the child lives; be safe
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
