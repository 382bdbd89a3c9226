"""CRIU through its RPC interface, and checks on the images it writes and reads.

The helper starts ``criu swrk FD`` itself with ``subprocess`` (through ``setpriv`` when CRIU
runs as the caller, see creds.py) and speaks CRIU's RPC over the other end of the socket with
pycriu's protobuf messages: pycriu's own launcher forks the helper with ``os.fork`` (unsafe in
a threaded process) and waits for CRIU with ``waitpid``, which the helper's reaper must never
race with; and its request call does not answer CRIU's notifications, which the helper uses
(the dumped tree is checked while still frozen; a restored tree is recorded before it runs).

Options are fixed here, one set for dump and one for restore; nothing a client sends can add
to them. Every run has a deadline (the watchdog): past it CRIU is killed and the op fails.
"""

from __future__ import annotations

import array
import contextlib
import errno
import importlib
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .cgroups import join as join_cgroup
from .creds import RunAs, find_setpriv
from .holds import hold
from .protocol import RequestError

log = logging.getLogger(__name__)

DUMP_LOG = "criu.log"
RESTORE_LOG = "restore.log"
LOG_LEVEL = 4
LOG_TAIL_LINES = 30
_SWRK: set[int] = set()  # running_criu()
_SWRK_LOCK = threading.Lock()


class CriuFailed(RequestError):
    def __init__(self, message: str) -> None:
        super().__init__("criu_failed", message)


def load_pycriu(path: str | None) -> ModuleType:
    """Import pycriu, from ``path`` first when given (it is not on PyPI)."""
    if path and path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("pycriu")


def criu_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"Version:\s*(\S+)", out.stdout)
    if not match:
        raise RuntimeError(f"cannot read the version of {binary}: {out.stdout!r}")
    return match.group(1)


def full_filesystem(dir_fd: int, least: int = 1 << 20) -> str:
    """A failed CRIU run on a filesystem with (almost) no room left: say so first. Its log, on
    the same full filesystem, may have lost the line that says why."""
    try:
        st = os.fstatvfs(dir_fd)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= least:
        return ""
    return f"{os.strerror(errno.ENOSPC)} where the images are written ({free} bytes free); CRIU: "


# CRIU's log lines: "(00.027894)      2: Error (criu/sk-inet.c:1059): inet: Can't bind ..." (the
# time since CRIU started, the restored task's pid in the images where a task wrote it, then
# the message; criu/log.c and include/log.h).
_LOG_LINE = re.compile(r"^\(\s*[\d.]+\)\s(?:\s*(\d+): )?(.*)$")
_ERROR = re.compile(r"^Error \(([^()]*)\): (.*)$")
# what CRIU prints of each inet socket it restores, just before it binds it (sk-inet.c)
_INET_RESTORE = re.compile(r"Restore: family (\S+)\s+type (\S+)\s+proto (\S+)\s+port (\d+)\s+"
                           r"state (\S+)\s+src_addr (\S+)")
_INET_BIND_IN_USE = re.compile(r"^inet: Can't bind inet socket \(id [^)]*\): "
                               r"Address already in use$")
_UNIX_BIND_IN_USE = re.compile(r"^unix: Can't bind id \S+ ino \d+ addr (.*): "
                               r"Address already in use$")
# Error lines that say nothing about why a run failed: CRIU prints them on runs that succeed.
HARMLESS_ERRORS = (
    # the helper's root lacks CAP_SYS_RESOURCE, or CRIU runs as the caller: it keeps its limit
    re.compile(r"^rlimit: Can't setup RLIMIT_NOFILE for self"),
)
# Error lines CRIU prints after the cause, while each layer gives up on the one below it.
GIVING_UP = re.compile(
    r"(?:^(?:Pre-d|D)umping FAILED\.|^Restoring FAILED\.|^\d+ exited, status=|"
    r"^\d+ killed by signal|^Unable to open fd=|\(pid: \d+\) failed with -?\d+$)")
LOG_SCAN_BYTES = 64 << 20  # a failed run's log is scanned from at most this far before its end
LOG_ERROR_LINES = 10


@dataclass(frozen=True)
class LogReport:
    """What a failed CRIU run's log says: the cause first, then CRIU's own lines."""

    cause: str | None  # the cause in words, translated where it is recognised
    excerpt: str  # CRIU's error lines (harmless ones left out), then the log's last lines


def _harmless(message: str) -> bool:
    return any(p.search(message) for p in HARMLESS_ERRORS)


def _translate(message: str, inet: tuple[str, ...] | None) -> str:
    """A cause CRIU names in its own terms, said in the user's where it is recognised."""
    if _INET_BIND_IN_USE.search(message):
        if inet is not None:
            _family, kind, proto, port, _state, addr = inet
            what = proto.removeprefix("IPPROTO_") if proto.startswith("IPPROTO_") else kind
            return (f"port {port} is taken by another process ({what} on {addr}, bound by the "
                    f"snapshot's kernel; CRIU: {message})")
        return f"a port the snapshot's kernel had is taken by another process (CRIU: {message})"
    match = _UNIX_BIND_IN_USE.search(message)
    if match:
        path = match.group(1)
        if path:
            return (f"socket path {path} is taken (another socket or file is there; CRIU: "
                    f"{message})")
        return f"an abstract unix socket name the snapshot's kernel had is taken (CRIU: {message})"
    return message


def parse_log(text: str, lines: int = LOG_TAIL_LINES) -> LogReport:
    """The cause of a failed CRIU run, from its log: CRIU's first error line that is neither
    one every run prints (:data:`HARMLESS_ERRORS`) nor one of those it prints while giving up
    after the cause (:data:`GIVING_UP`: "Restoring FAILED.", "2 exited, status=1", ...).
    CRIU's own first error (the RPC answer's ``cr_errmsg``) is often a harmless one."""
    all_lines = text.splitlines()
    errors: list[tuple[str, str]] = []  # (line, message)
    causes: list[str] = []
    fallback: str | None = None
    inet: dict[str | None, tuple[str, ...]] = {}  # task -> its last inet socket restored
    for line in all_lines:
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        task, rest = match.group(1), match.group(2)
        sock = _INET_RESTORE.search(rest)
        if sock is not None:
            inet[task] = sock.groups()
            continue
        error = _ERROR.match(rest)
        if error is None:
            continue
        message = error.group(2).strip()
        if _harmless(message):
            continue
        errors.append((line, message))
        if GIVING_UP.search(message):
            fallback = fallback or message
        elif not causes:
            causes.append(_translate(message, inet.get(task)))
    cause = causes[0] if causes else fallback
    shown = [line for line, _ in errors[:LOG_ERROR_LINES]]
    picked = set(shown)
    shown += [line for line in all_lines[-lines:] if line not in picked]
    return LogReport(cause, "\n".join(shown))


def read_log(dir_fd: int, name: str) -> str | None:
    """A CRIU log's text (its last :data:`LOG_SCAN_BYTES`), or None where there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > LOG_SCAN_BYTES:
            f.seek(size - LOG_SCAN_BYTES)
            f.readline()  # a line cut in two
        return f.read(LOG_SCAN_BYTES).decode(errors="replace")


def log_report(dir_fd: int, name: str, lines: int = LOG_TAIL_LINES) -> LogReport:
    text = read_log(dir_fd, name)
    if text is None:
        return LogReport(None, "(no CRIU log)")
    return parse_log(text, lines)


def log_tail(dir_fd: int, name: str, lines: int = LOG_TAIL_LINES) -> str:
    """A failed CRIU run's log for an error message a person can act on: the cause first (see
    :func:`parse_log`), then CRIU's error lines, then the log's last lines."""
    report = log_report(dir_fd, name, lines)
    return report.excerpt if report.cause is None else f"{report.cause}\n{report.excerpt}"


def failure_message(dir_fd: int, name: str, criu_word: str) -> str:
    """Why a CRIU run that answered "failed" failed: the cause its log names, else CRIU's own
    word (its first error, unless that is a harmless one), then the log's excerpt."""
    report = log_report(dir_fd, name)
    cause = report.cause
    if cause is None:
        word = _ERROR.match(criu_word.strip())
        message = word.group(2) if word else criu_word.strip()
        cause = "CRIU's log names no cause" if _harmless(message) else criu_word.strip()
    return f"{cause}\n{report.excerpt}"


@dataclass(frozen=True)
class CriuSettings:
    binary: str
    pycriu_path: str | None
    # The watchdog: a CRIU run gets ``timeout_s`` plus one second per ``min_rate`` bytes of
    # memory it moves, then it is killed. Deadlines are hang guards, sized so that a healthy
    # run on a slow, busy machine never comes near them.
    timeout_s: float = 300.0
    min_rate: float = 16 * 2**20


Notify = Callable[[str, int | None], None]


class KeyedLocks:
    """One lock per key, created on demand, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[object, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, key: object | None) -> Iterator[None]:
        if key is None:
            yield
            return
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


class Criu:
    """Runs single CRIU requests, each in its own ``criu swrk`` process, under a watchdog.

    Requests of different callers run at the same time. Only dumps of PID-namespaced trees
    whose inits share a cwd are serialized (``lock_key``): CRIU's parasite creates a fixed-name
    mount point there (see nsinit.py), and each uid's inits have their own cwd.
    """

    def __init__(self, settings: CriuSettings) -> None:
        self.binary = settings.binary
        self.pycriu = load_pycriu(settings.pycriu_path)
        self.version = criu_version(self.binary)
        self.settings = settings
        self.locks = KeyedLocks()
        self._setpriv: str | None = None

    def deadline_s(self, moved_bytes: int) -> float:
        return self.settings.timeout_s + moved_bytes / self.settings.min_rate

    def _argv(self, fd: int, run_as: RunAs | None) -> list[str]:
        return [*self.command(run_as), "swrk", str(fd)]

    def command(self, run_as: RunAs | None) -> list[str]:
        """CRIU's binary, run as ``run_as`` (None: root)."""
        if run_as is None:
            return [self.binary]
        if self._setpriv is None:
            self._setpriv = find_setpriv()
        return [*run_as.setpriv_argv(self._setpriv), self.binary]

    def _request(self, kind: str, images_fd: int, log_name: str, configure: Any, *,
                 run_as: RunAs | None, deadline_s: float, on_notify: Notify | None = None,
                 watch: Callable[[], None] | None = None,
                 on_abort: Callable[[], None] | None = None,
                 cgroup_procs: str | None = None, extra_fds: tuple[int, ...] = ()) -> Any:
        """One CRIU request over its RPC socket, CRIU's notifications answered on the way.

        ``on_notify(action, pid)`` runs at each of CRIU's notifications (``post-dump``: the
        tree dumped and still frozen; ``post-restore``: the tree created, not yet resumed);
        if it raises, CRIU is told the step failed (it resumes a dumped tree, kills a
        restored one) and that error is raised once CRIU has answered.
        Past ``deadline_s`` CRIU is killed and the request fails with ``criu_failed``;
        ``watch()`` runs every second while CRIU works, and if it raises, CRIU is killed and
        that error is raised. ``on_abort()`` runs after CRIU was killed (a restore's
        half-made tree must not outlive it: its tasks would wait, or spin, for ever).
        """
        rpc = self.pycriu.rpc
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            swrk = subprocess.Popen(
                self._argv(theirs.fileno(), run_as),
                pass_fds=(theirs.fileno(), images_fd, *extra_fds),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                # Not the helper's stderr: CRIU may run as the caller, and what it forks (the
                # restored tree) would keep a writable descriptor on root's log. CRIU logs to
                # its log file in the images dir.
                stderr=subprocess.DEVNULL,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                cwd="/",
            )
        finally:
            theirs.close()
        with _SWRK_LOCK:
            _SWRK.add(swrk.pid)
        if cgroup_procs is not None:  # before CRIU creates any task: they inherit it
            try:
                join_cgroup(cgroup_procs, swrk.pid)
            except RequestError:  # nothing restored yet: CRIU still waits for its request
                ours.close()
                _kill(swrk)
                raise
        deadline = time.monotonic() + deadline_s
        failure: RequestError | None = None
        try:
            opts = rpc.criu_opts(images_dir_fd=-1)
            # CRIU, possibly running as the caller, opens the staging dir through its own
            # copy of the descriptor (not /proc/<helper>/fd, which is the helper's alone).
            opts.images_dir = f"/proc/self/fd/{images_fd}"
            opts.log_file = log_name
            opts.log_level = LOG_LEVEL
            opts.notify_scripts = True
            if run_as is not None:
                opts.unprivileged = True
            configure(opts)
            req = rpc.criu_req(type=rpc.DUMP if kind == "dump" else rpc.RESTORE)
            req.opts.MergeFrom(opts)
            hold(f"criu_{kind}_request", criu_pid=swrk.pid)
            _send(ours, req, deadline)
            while True:
                resp = rpc.criu_resp()
                resp.ParseFromString(_recv_watched(ours, deadline, watch))
                if resp.type != rpc.NOTIFY:
                    break
                action = resp.notify.script
                pid = resp.notify.pid if resp.notify.HasField("pid") else None
                hold(f"criu_{kind}_{action}", criu_pid=swrk.pid, pid=pid)
                ok = True
                if on_notify is not None and failure is None:
                    try:
                        on_notify(action, pid)
                    except RequestError as exc:
                        failure, ok = exc, False
                _send(ours, rpc.criu_req(type=rpc.NOTIFY, notify_success=ok), deadline)
            hold(f"criu_{kind}_response", criu_pid=swrk.pid)
        except RequestError:
            _kill(swrk, on_abort)  # the watch found something wrong
            raise
        except TimeoutError:
            _kill(swrk, on_abort)
            raise CriuFailed(
                f"CRIU {kind} did not finish within {deadline_s:.0f} s and was stopped (a stalled "
                f"CRIU holds nobody else's operation, but this one is lost)\n"
                f"{log_tail(images_fd, log_name)}") from None
        except (OSError, ValueError) as exc:  # CRIU died, or sent garbage
            _kill(swrk, on_abort)
            raise CriuFailed(f"CRIU {kind} failed: {exc}\n{log_tail(images_fd, log_name)}") from None
        finally:
            ours.close()
            try:
                swrk.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(swrk, on_abort)
            _waited(swrk)
        if failure is not None:
            raise failure
        if not resp.success:
            why = resp.cr_errmsg or (os.strerror(resp.cr_errno) if resp.cr_errno else "error")
            raise CriuFailed(f"CRIU {kind} failed: {full_filesystem(images_fd)}"
                             f"{failure_message(images_fd, log_name, why)}")
        return resp

    def dump(self, pid: int, images_fd: int, *, leave_running: bool, run_as: RunAs | None,
             deadline_s: float, on_notify: Notify | None = None,
             watch: Callable[[], None] | None = None, externals: list[str] = ()) -> None:
        """Dump the tree rooted at ``pid``. On failure CRIU resumes the tree. ``externals``:
        ids of sockets whose peers may be outside the tree (unix_peers.py)."""

        def configure(opts: Any) -> None:
            opts.pid = pid
            opts.external.extend(externals)
            opts.leave_running = leave_running
            opts.tcp_established = True
            # A client connecting while the tree is frozen leaves a connection not yet
            # accepted ("in flight"); without this the dump fails on it. Left out, the client
            # sees a reset and reconnects (ZMQ does).
            opts.tcp_skip_in_flight = True
            opts.network_lock = self.pycriu.rpc.SKIP  # no iptables/nft needed; see FINDINGS
            opts.file_locks = True

        self._request("dump", images_fd, DUMP_LOG, configure, run_as=run_as,
                      deadline_s=deadline_s, on_notify=on_notify, watch=watch)

    def restore(self, images_fd: int, *, run_as: RunAs | None, deadline_s: float,
                on_notify: Notify | None = None, watch: Callable[[], None] | None = None,
                on_abort: Callable[[], None] | None = None,
                cgroup_procs: str | None = None,
                inherit: list[tuple[str, int]] = (), lazy: bool = False) -> int:
        """Restore a tree as a child of the helper; return the root's host pid. ``inherit``:
        (CRIU's resource key, descriptor) pairs put in place of those resources. ``lazy``:
        private memory is left to a running lazy-pages daemon (lazy_pages.py)."""

        def configure(opts: Any) -> None:
            opts.lazy_pages = lazy
            for key, fd in inherit:
                opts.inherit_fd.add(key=key, fd=fd)
            # Connections of snapshot time have no live peer any more (and restoring them
            # established would clash with the live 4-tuples of a branch restored beside it):
            # they come back closed, and the clients reconnect to the restored listeners.
            opts.tcp_close = True
            opts.rst_sibling = True
            opts.file_locks = True

        resp = self._request("restore", images_fd, RESTORE_LOG, configure, run_as=run_as,
                             deadline_s=deadline_s, on_notify=on_notify, watch=watch,
                             on_abort=on_abort, cgroup_procs=cgroup_procs,
                             extra_fds=tuple(fd for _, fd in inherit))
        return int(resp.restore.pid)

    # --- image inspection -------------------------------------------------------------------

    def load_image(self, dir_fd: int, name: str) -> dict[str, Any]:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            try:
                return self.pycriu.images.load(f)
            except Exception as exc:  # noqa: BLE001 - any decode failure means damaged images
                raise RequestError("bad_request", f"image {name} cannot be read: {exc}") from None

    def pagemap(self, dir_fd: int, name: str) -> tuple[int, list[tuple[int, int]]]:
        """A pagemap image's ``pages_id`` and its entries' ``(nr_pages, flags)``, read as
        protobuf messages: ``load_image``'s conversion to dicts took 140 ms for the 80 KB
        pagemap of a 4 GiB kernel, on every restore's check (issue 32's wake)."""
        found = self.messages(dir_fd, name, "PAGEMAP", "pagemap_entry", head="pagemap_head")
        if not found or not found[0].HasField("pages_id"):
            raise RequestError("bad_request", f"damaged images: {name} has no header")
        return found[0].pages_id, [(e.nr_pages, e.flags) for e in found[1:]]

    def pagemap_entries(self, dir_fd: int, name: str) -> tuple[int, list[tuple[int, int, int]]]:
        """As ``pagemap``, each entry as ``(vaddr, nr_pages, flags)``."""
        found = self.messages(dir_fd, name, "PAGEMAP", "pagemap_entry", head="pagemap_head")
        if not found or not found[0].HasField("pages_id"):
            raise RequestError("bad_request", f"damaged images: {name} has no header")
        return found[0].pages_id, [(e.vaddr, e.nr_pages, e.flags) for e in found[1:]]

    def clear_lazy(self, dir_fd: int, name: str, entries: set[int]) -> None:
        """Rewrite the pagemap image ``name`` in ``dir_fd`` (a staging dir of the helper's)
        with the lazy flag off on ``entries`` (indexes among its entries), so that CRIU's
        restore reads those pages itself and its page daemon leaves them: a new file put in
        its place, the owner and mode kept."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read()
        magic, found = self._parse(name, data, "PAGEMAP", "pagemap_entry", "pagemap_head")
        out = [data[:magic]]
        for i, msg in enumerate(found):
            if i - 1 in entries:
                msg.flags &= ~PE_LAZY
            body = msg.SerializeToString()
            out += [struct.pack("i", len(body)), body]
        tmp = f".{name}.eager"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     st.st_mode & 0o777, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchown(f.fileno(), st.st_uid, st.st_gid)
                f.write(b"".join(out))
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise

    def messages(self, dir_fd: int, name: str, magic: str, message: str,
                 head: str | None = None) -> list[Any]:
        """The entries of an image (``magic``, e.g. "FILES") as protobuf messages of
        ``message`` (e.g. "file_entry"; the first of ``head``'s type where the image has a
        header), without ``load_image``'s conversion to dicts: a restore's checks read
        files.img twice, about 40 ms each as dicts (issue 32's wake)."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        return self._parse(name, data, magic, message, head)[1]

    def _parse(self, name: str, data: bytes, magic: str, message: str,
               head: str | None) -> tuple[int, list[Any]]:
        """``messages`` of an image's bytes, with the length of its magic numbers."""
        images = self.pycriu.images
        try:
            (found,), at = struct.unpack_from("i", data, 0), 4
            if found in (images.by_name["IMG_COMMON"], images.by_name["IMG_SERVICE"]):
                (found,), at = struct.unpack_from("i", data, 4), 8
            if images.by_val.get(found) != magic:
                raise ValueError(f"not a {magic} image (magic {found:#x})")
            start, out = at, []
            while at < len(data):
                (size,) = struct.unpack_from("i", data, at)
                at += 4
                if size < 0 or at + size > len(data):
                    raise ValueError("an entry runs past the end")
                msg = getattr(images.pb, head if head and not out else message)()
                msg.ParseFromString(data[at:at + size])
                out.append(msg)
                at += size
        except Exception as exc:  # noqa: BLE001 - any decode failure means damaged images
            raise RequestError("bad_request", f"image {name} cannot be read: {exc}") from None
        return start, out


def _send(sk: socket.socket, req: Any, deadline: float) -> None:
    sk.settimeout(max(0.001, deadline - time.monotonic()))
    sk.send(req.SerializeToString())


def _recv(sk: socket.socket, deadline: float) -> bytes:
    """One message; descriptors CRIU may attach to a notification are closed."""
    sk.settimeout(max(0.001, deadline - time.monotonic()))
    data, ancdata, _flags, _addr = sk.recvmsg(1 << 20, socket.CMSG_SPACE(64 * 4))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            for fd in array.array("i", payload[: len(payload) - len(payload) % 4]):
                os.close(fd)
    if not data:
        raise OSError("CRIU exited before it answered")
    return data


WATCH_TICK_S = 1.0


def _recv_watched(sk: socket.socket, deadline: float, watch: Callable[[], None] | None) -> bytes:
    while True:
        tick = deadline if watch is None else min(deadline, time.monotonic() + WATCH_TICK_S)
        try:
            return _recv(sk, tick)
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
            assert watch is not None
            watch()


def running_criu() -> frozenset[int]:
    """The pids of the CRIU processes the helper has started and not yet waited for (a
    zombie among them is theirs to reap, not a task of a failed restore)."""
    with _SWRK_LOCK:
        return frozenset(_SWRK)


def _waited(proc: subprocess.Popen) -> None:
    with _SWRK_LOCK:
        _SWRK.discard(proc.pid)


def _kill(proc: subprocess.Popen, on_abort: Callable[[], None] | None = None) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()
    _waited(proc)
    if on_abort is not None:
        try:
            on_abort()
        except Exception:  # noqa: BLE001 - the original failure is what the caller must see
            log.exception("cleaning up after an aborted CRIU run failed")


def image_names(dir_fd: int) -> list[str]:
    return sorted(e.name for e in os.scandir(dir_fd) if e.is_file(follow_symlinks=False))


def tree_tasks(criu: Criu, dir_fd: int) -> list[dict[str, Any]]:
    """pstree.img's entries: the tree root first, each with its ``pid`` and ``threads``."""
    if "pstree.img" not in image_names(dir_fd):
        raise RequestError("bad_request", "not a CRIU images directory (no pstree.img)")
    tasks = criu.load_image(dir_fd, "pstree.img").get("entries", [])
    if not tasks:
        raise RequestError("bad_request", "pstree.img lists no process")
    return tasks


def private_page_files(criu: Criu, dir_fd: int) -> set[str]:
    """The ``pages-*.img`` holding private memory of the tasks *below* the tree root.

    Only these may be sealed by size alone: their bytes become memory of processes that run
    with the caller's credentials. The root's (a root-owned nsinit) and shared memory are
    sealed by hash like everything else.
    """
    tasks = tree_tasks(criu, dir_fd)
    root_pages: set[str] = set()
    below: set[str] = set()
    names = set(image_names(dir_fd))
    for index, task in enumerate(tasks):
        name = f"pagemap-{task['pid']}.img"
        if name not in names:
            continue
        # as protobuf messages: as dicts (load_image), the pagemap of a kernel of 4 GiB took
        # 0.2 s to read, inside the hold an automatic snapshot puts on its cell (issue 30)
        found = criu.messages(dir_fd, name, "PAGEMAP", "pagemap_entry", head="pagemap_head")
        if found and found[0].HasField("pages_id"):
            (root_pages if index == 0 else below).add(f"pages-{found[0].pages_id}.img")
    return below - root_pages


PE_PARENT = 1  # pagemap entry flags (CRIU images/pagemap.proto)
PE_LAZY = 2
PE_PRESENT = 4


def check_page_files(criu: Criu, dir_fd: int) -> None:
    """Refuse images whose page files do not hold exactly the pages their pagemaps list.

    CRIU itself does not stop on a short page file: restoring one spun at 100% CPU for good
    (CRIU 4.2.1), after the kernel being replaced was already gone. Checked before that.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    names = set(image_names(dir_fd))
    for name in sorted(n for n in names if n.startswith("pagemap") and n.endswith(".img")):
        pages_id, entries = criu.pagemap(dir_fd, name)
        pages = f"pages-{pages_id}.img"
        want = page * sum(n for n, flags in entries
                          if flags & PE_PRESENT and not flags & PE_PARENT)
        have = os.stat(pages, dir_fd=dir_fd, follow_symlinks=False).st_size \
            if pages in names else None
        if (have or 0) != want:
            raise RequestError(
                "bad_request", f"damaged images: {pages} holds "
                f"{'nothing' if have is None else f'{have} bytes'}, {name} lists {want}")


def _cap_bits(creds: dict[str, Any], key: str) -> int:
    return sum(int(word) << (32 * i) for i, word in enumerate(creds.get(key, [])))


def _creds_problem(creds: dict[str, Any] | None, uid: int, allowed: set[int],
                   allowed_caps: int) -> str | None:
    if creds is None:
        return "carries no credentials"
    uids = [creds.get(k) for k in ("uid", "euid", "suid", "fsuid")]
    gid_fields = [creds.get(k) for k in ("gid", "egid", "sgid", "fsgid")]
    groups = list(creds.get("groups", []))
    if any(u != uid for u in uids):
        return f"runs as uid(s) {uids}, not {uid}"
    if any(g not in allowed for g in gid_fields + groups):
        return f"has groups outside uid {uid}'s"
    held = 0
    for key in ("cap_inh", "cap_prm", "cap_eff", "cap_amb"):
        held |= _cap_bits(creds, key)
    if held & ~allowed_caps and uid != 0:
        return f"holds capabilities {held & ~allowed_caps:#x}"
    return None


def check_creds(criu: Criu, dir_fd: int, uid: int, gids: Iterable[int], *,
                init_groups: Iterable[int] = (), init_caps: Iterable[int] = ()) -> int:
    """Refuse images with any process whose credentials are not the caller's: every uid field
    equals ``uid``, every gid field and supplementary group is one of ``gids``, no capability
    held (a process of an ordinary user has none).

    The tree's init (the first task) may also hold ``init_groups`` and the capabilities
    ``init_caps``: the init the helper starts for a non-root caller in a PID namespace holds
    its own group and two capabilities (see nsinit.py). Such images are only accepted with a
    valid seal naming the caller, and the init's memory is sealed by hash, so its code cannot
    be changed in between. Returns the number of threads checked below the init; there must
    be at least one.
    """
    allowed = set(gids)
    caps_mask = sum(1 << cap for cap in init_caps)
    tasks = tree_tasks(criu, dir_fd)
    names = set(image_names(dir_fd))
    checked_below = 0
    for index, task in enumerate(tasks):
        for tid in task.get("threads", []):
            name = f"core-{tid}.img"
            if name not in names:
                raise RequestError("bad_request", f"images lack {name}")
            entries = criu.load_image(dir_fd, name).get("entries", [])
            creds = (entries[0].get("thread_core") or {}).get("creds") if entries else None
            if index == 0:
                problem = _creds_problem(creds, uid, allowed | set(init_groups), caps_mask)
            else:
                problem = _creds_problem(creds, uid, allowed, 0)
            if problem:
                raise RequestError("permission_denied", f"process {task['pid']} ({name}) {problem}")
            checked_below += index > 0
    if checked_below == 0:
        raise RequestError("bad_request", "the images hold no process below the tree's init")
    return checked_below
