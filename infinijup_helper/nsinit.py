"""A kernel tree's launcher and its init (PID 1 of its PID namespace), in one standalone file.

The helper copies this file to ``<work>/.nsinit/nsinit.py`` (root-owned, world-readable) and
runs it from there with a root-owned Python in isolated mode (``-I``), so it imports only the
standard library and every user can execute what their own tree's init runs.

``python -I nsinit.py launch`` (root, the spawn spec as JSON on stdin): the *launcher*, a
short-lived single-threaded process (the helper is multithreaded and must not fork itself).
It applies the caller's resource limits, joins the caller's cgroup (see cgroups.py; if it
cannot, it starts nothing),
optionally ``unshare(CLONE_NEWPID)``, and forks the init, which becomes the caller (see below) and execs ``python -I nsinit.py --owner UID`` with
a clean environment, stdio on /dev/null, cwd ``<work>/.nsinit/<uid>``, the spec on fd 3 and
fd 4 for reporting a failure. The launcher waits until the kernel's exec succeeded or failed,
prints the init's pid or the failure as JSON, and exits; the init is reparented to the helper
(a subreaper). PR_SET_PDEATHSIG is deliberately not set: a helper restart must not take
kernels with it.

Why an init at all: CRIU dumps and restores a whole PID namespace by its init, and an init
must reap orphans and pass on the signals Jupyter sends (SIGINT is "interrupt the kernel").

Whose init: for root, root. For anyone else the init runs as the caller (uid, gid, groups),
so that CRIU too can run as the caller (see creds.py). In a PID namespace it keeps exactly two
capabilities: CAP_SYS_ADMIN, because CRIU's parasite, running with the init's credentials,
mounts a /proc for the namespace in the init's cwd during a dump; and CAP_SETGID, to drop the
extra group ``infinijup-nsinit`` (which lets it create that mount point in its root-owned cwd,
where the caller's other processes cannot meddle) when it forks the kernel. The init is kept
dumpable so that CRIU, as the caller, can read its /proc files; the caller still cannot
ptrace it or read its memory (the kernel refuses that to a process without those
capabilities). The kernel drops everything: the caller's groups, gid and uid, no capability,
then opens its log, enters ``cwd`` and execs ARGV.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import resource
import signal
import sys

SPEC_FD = 3
ERROR_FD = 4
OWNER_FLAG = "--owner"
KERNEL_UMASK = 0o022
CLONE_NEWPID = 0x20000000
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
SPEC_KEYS = ("argv", "env", "cwd", "log_path", "uid", "gid", "groups")

# --- capabilities, through libc (the standard library has no capset) ---------------------------
CAP_SETGID = 6
CAP_SYS_ADMIN = 21
INIT_CAPS_PIDNS = (CAP_SYS_ADMIN, CAP_SETGID)
PR_SET_DUMPABLE = 4
PR_SET_KEEPCAPS = 8
PR_SET_CHILD_SUBREAPER = 36
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
PR_CAP_AMBIENT_CLEAR_ALL = 4
_SYS_CAPSET = 126  # x86_64
_CAP_V3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0, arg2: int = 0) -> None:
    _check(_libc.prctl(option, arg, arg2, 0, 0), f"prctl({option})")


def set_caps(caps: tuple[int, ...]) -> None:
    """Effective, permitted and inheritable sets all exactly ``caps``."""
    mask = 0
    for cap in caps:
        mask |= 1 << cap
    header = _CapHeader(_CAP_V3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = data[i].inheritable = word
    _check(_libc.syscall(_SYS_CAPSET, ctypes.byref(header), data), "capset")


# --- the init -----------------------------------------------------------------------------------


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
        if sorted(os.getgroups()) != sorted(spec["groups"]):
            os.setgroups(spec["groups"])
        step = "setgid"
        os.setresgid(spec["gid"], spec["gid"], spec["gid"])
        step = "setuid"
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        if spec["uid"] != 0:
            step = "drop capabilities"
            set_caps(())
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
    except BaseException as exc:  # never run on with the init's privileges
        os.write(ERROR_FD, f"{step}: {exc}".encode(errors="replace"))
    os._exit(127)


def _start_kernel(spec: dict) -> int:
    """Set the init up and fork the kernel; its pid."""
    if os.getuid() != 0:
        # Ambient capabilities got the init's two through its exec; the kernel's exec must
        # not inherit them. Dumpable, so that CRIU running as the caller can read our /proc.
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        _prctl(PR_SET_DUMPABLE, 1)
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader
    if os.getpid() != 1:
        # No PID namespace (see spawn.py): orphans of the kernel's subprocesses come to us
        # rather than leaving the tree, so CRIU still dumps them with it.
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
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
    return child


def init_main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != OWNER_FLAG or not argv[1].isdigit():
        os.write(2, b"usage: nsinit.py --owner UID  (spec on fd 3; started by infinijup_helper)\n")
        return 2
    spec = _read_spec()
    if int(argv[1]) != spec["uid"] or os.getuid() not in (0, spec["uid"]):
        os.write(ERROR_FD, b"nsinit: --owner does not match the spec's uid")
        return 2
    try:
        child = _start_kernel(spec)
    except BaseException as exc:  # the launcher reports it: nothing may fail silently
        os.write(ERROR_FD, f"nsinit: {exc}".encode(errors="replace"))
        return 127
    os.close(ERROR_FD)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0  # cannot happen while the child lives; be safe
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


# --- the launcher (root, single-threaded) ----------------------------------------------------


def _apply_rlimits(limits: dict) -> None:
    """The caller's resource limits, for the init and so for the kernel (root can raise them
    here; once the init is the caller nothing in the tree can raise a hard limit)."""
    for name, (soft, hard) in limits.items():
        res = getattr(resource, name, None)
        if res is not None:
            resource.setrlimit(res, (soft, hard))


def _become_init_owner(spec: dict) -> None:
    """Before the exec of the init: the caller's ids, plus the init's capabilities."""
    if spec["uid"] == 0:
        return
    pidns = spec.get("pid_namespace", True)
    extra = [spec["nsinit_group"]] if pidns and spec.get("nsinit_group") is not None else []
    os.setgroups(list(dict.fromkeys([*extra, *spec["groups"]])))
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    caps = INIT_CAPS_PIDNS if pidns else ()
    _prctl(PR_SET_KEEPCAPS, 1)
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    set_caps(caps)
    for cap in caps:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap)
    _prctl(PR_SET_KEEPCAPS, 0)


def _exec_init(spec: dict, spec_r: int, error_w: int, report: list[int]) -> None:
    """In the namespace's PID 1: arrange fds 0-4, become the owner, exec the init.
    ``report[0]``: where a failure is to be written (the error pipe, wherever it is now)."""
    os.setsid()
    os.chdir(spec["nsinit_cwd"])
    high_spec = fcntl.fcntl(spec_r, fcntl.F_DUPFD, 10)
    high_error = fcntl.fcntl(error_w, fcntl.F_DUPFD, 10)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.dup2(high_spec, SPEC_FD)
    os.dup2(high_error, ERROR_FD)
    report[0] = ERROR_FD
    os.closerange(ERROR_FD + 1, os.sysconf("SC_OPEN_MAX"))
    _become_init_owner(spec)
    python = spec["python"]
    os.execve(python, [python, "-I", spec["nsinit_path"], OWNER_FLAG, str(spec["uid"])], {})


def _join_cgroup(procs: str | None) -> str | None:
    """Move the launcher (so the tree it forks) into the caller's cgroup; why not, or None."""
    if not procs:
        return None
    try:
        fd = os.open(procs, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    except OSError as exc:
        return (f"join the caller's cgroup {os.path.dirname(procs)}: {exc.strerror} (a kernel "
                "runs in its caller's cgroup; --cgroup none leaves kernels in the helper's)")
    return None


def launch_main() -> int:
    spec = json.load(sys.stdin)
    try:
        _apply_rlimits(spec.get("rlimits") or {})
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": f"setrlimit: {exc}"}))
        return 1
    cgroup_problem = _join_cgroup(spec.get("cgroup_procs"))
    if cgroup_problem:  # a kernel runs in its caller's cgroup or not at all
        print(json.dumps({"error": cgroup_problem}))
        return 1
    if spec.get("pid_namespace", True) and _libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        print(json.dumps({"error": f"unshare(CLONE_NEWPID): {os.strerror(err)}"}))
        return 1
    spec_r, spec_w = os.pipe2(os.O_CLOEXEC)
    errors_r, errors_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        report = [errors_w]
        try:
            os.close(spec_w)
            os.close(errors_r)
            _exec_init(spec, spec_r, errors_w, report)
        except BaseException as exc:  # report anything
            why = str(exc)
            if isinstance(exc, OSError) and exc.errno == errno.EAGAIN:
                why = (f"the user has reached their process limit (RLIMIT_NPROC "
                       f"{resource.getrlimit(resource.RLIMIT_NPROC)[0]}): {exc.strerror}")
            os.write(report[0], f"start nsinit: {why}".encode(errors="replace")[:4000])
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


def main(argv: list[str]) -> int:
    if argv == ["launch"]:
        return launch_main()
    return init_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
