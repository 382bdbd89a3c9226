"""Lazy restore: the tree runs before its memory is back.

CRIU restores the process tree with its private anonymous memory registered with a
userfaultfd per process, and its ``lazy-pages`` daemon (started here, as the caller, on the
restore's staging dir) copies each page in on first touch and streams the rest behind the
running kernel, then exits 0: the tree is fully resident.

The danger is the daemon ending early. A fault on a registered range waits for the daemon,
but once the last descriptor of a userfaultfd is closed the kernel forgets the registration
and a fault gets a fresh zero page: the kernel would go on with wrong memory and no error.
So the helper keeps its own reference to every userfaultfd the daemon holds (``pidfd_getfd``;
all of them taken before the tree resumes, then renewed every ``WATCH_S`` for the processes
the kernel forks). A fault without a daemon then waits, killably, and the watcher, which sees
the daemon end (its pidfd), kills the tree and records why; only then are the references
dropped.

A renewal drops the references to userfaultfds the daemon no longer shows only when the scan
was of a live daemon (not exiting: ``PF_EXITING`` is set before an exiting process's
descriptors are closed): the daemon let go of those itself (that process's memory is all
back, or it exited). A renewal that runs late, or after the daemon died, keeps everything,
so no timing lets a fault be zero-filled for a process whose descriptor was taken. The one
gap left: a process forked after the last renewal, whose new userfaultfd only the daemon
holds; if the daemon dies before the next renewal (``WATCH_S``; later on a busy machine), that
process's untouched pages read as zeros until the watcher has killed the tree.

Hold points (holds.py) for the tests: ``lazy_pages_renew`` (the watcher about to scan the
daemon's descriptors) and ``lazy_pages_ended`` (the daemon gone, the tree not yet killed).

The page files stay in the staging dir until the daemon is done (``keep``): a linked page
file is the caller's own inode, and a caller who truncates it only breaks their own kernel
(the daemon's read fails, the tree is killed, the reason recorded).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .criu import CriuFailed, log_tail, tree_tasks
from .holds import hold
from .proc import pidfd_getfd
from .protocol import RequestError

if TYPE_CHECKING:
    from .page_source import PageSource

log = logging.getLogger(__name__)

SOCKET = "lazy-pages.socket"  # CRIU's fixed name, in the work dir (the staging dir)
LOG = "lazy-pages.log"
START_S = 30.0  # hang guards: the daemon's socket appears in milliseconds
RECEIVE_S = 60.0
WATCH_S = 0.05
UFFD_LINK = "anon_inode:[userfaultfd]"
PF_EXITING = 0x4  # include/linux/sched.h: set before an exiting task's descriptors close
class PageStream:
    """One lazy restore's page daemon, and the helper's hold on its userfaultfds."""

    def __init__(self, argv: list[str], staging_fd: int,
                 source: PageSource | None = None) -> None:
        self.staging_fd = staging_fd
        self.source = source  # pages asked of the caller, not read from files (page_source.py)
        extra, fds = [], [staging_fd]
        theirs = source.daemon_socket() if source is not None else None
        if theirs is not None:
            extra = ["--page-server", "--ps-socket", str(theirs.fileno())]
            fds.append(theirs.fileno())
        try:
            self.proc = subprocess.Popen(
                [*argv, "lazy-pages", "-D", f"/proc/self/fd/{staging_fd}", *extra,
                 "-o", LOG, "-v2"],
                pass_fds=tuple(fds), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                cwd="/")
        except BaseException:
            if source is not None:
                source.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()  # the daemon's now
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.started = time.monotonic()
        self.state = "starting"  # then streaming, resident or failed
        self.error: str | None = None
        self.resident_s: float | None = None
        self._held: list[int] = []
        self._lock = threading.Lock()
        self._kept = contextlib.ExitStack()
        try:
            self._wait_socket()
        except BaseException:
            self.abort()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_socket(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            try:
                os.stat(SOCKET, dir_fd=self.staging_fd, follow_symlinks=False)
                return
            except FileNotFoundError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise CriuFailed("CRIU's lazy-pages daemon did not start\n"
                                 + log_tail(self.staging_fd, LOG))
            time.sleep(0.005)

    def _uffds(self) -> list[int]:
        found = []
        base = f"/proc/{self.proc.pid}/fd"
        try:
            names = os.listdir(base)
        except OSError:
            return []
        for name in names:
            try:
                if os.readlink(f"{base}/{name}") == UFFD_LINK:
                    found.append(int(name))
            except OSError:
                continue
        return found

    def _live(self) -> bool:
        """The daemon is running, not exiting (its descriptors are its own choice)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return False
        if fields[0] in ("Z", "X", "x") or int(fields[6]) & PF_EXITING:
            return False
        return not select.select([self.pidfd], [], [], 0)[0]  # the pid not reused

    def _renew(self, watching: bool = False) -> int:
        """Take a reference to every userfaultfd the daemon holds now, then drop the old
        ones only if the daemon was live through the scan (see the module docs); how many
        the scan found."""
        if watching:
            hold("lazy_pages_renew", daemon_pid=self.proc.pid)
        new = []
        for fd in self._uffds():
            try:
                new.append(pidfd_getfd(self.pidfd, fd))
            except OSError:
                continue  # closed meanwhile (its process is fully resident, or gone)
        live = self._live()  # after the scan: a daemon exiting during it is caught here
        with self._lock:
            if live:
                old, self._held = self._held, new
            else:
                old, self._held = [], self._held + new
        for fd in old:
            os.close(fd)
        return len(new)

    def hold_uffds(self, expect: int) -> None:
        """At CRIU's post-restore (the tree made, not resumed): wait until the daemon has
        received the ``expect`` userfaultfds and take them; else the restore fails."""
        deadline = time.monotonic() + RECEIVE_S
        while self._renew() < expect:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RequestError(
                    "criu_failed", f"CRIU's lazy-pages daemon did not receive the {expect} "
                    "processes' memory to serve\n" + log_tail(self.staging_fd, LOG))
            time.sleep(0.005)
        self.state = "streaming"
        # CRIU has not told the daemon the restore finished: it streams nothing in the
        # background yet, and the tree is not resumed, so it has served no page
        hold("lazy_pages_held", daemon_pid=self.proc.pid)

    def keep(self, resources: contextlib.ExitStack) -> None:
        """What must outlive the restore op until the daemon is done (the staging dir)."""
        self._kept.enter_context(resources)

    def watch(self, kill_tree: Callable[[], None],
              on_end: Callable[[PageStream], None] = lambda s: None) -> None:
        """Follow the daemon in a thread until it exits (see the module docs)."""

        def run() -> None:
            ended = select.poll()
            ended.register(self.pidfd, select.POLLIN)  # readable once the daemon exited
            while not ended.poll(WATCH_S * 1000):
                self._renew(watching=True)
            self.proc.wait()
            state, error = "resident", None
            if self.proc.returncode != 0:
                why = self.source.error if self.source is not None else None
                error = (f"the page daemon ended (exit {self.proc.returncode}) before "
                         "the kernel's memory was back; the kernel was ended"
                         + (f" ({why})" if why else "") + "\n"
                         + log_tail(self.staging_fd, LOG))
                state = "failed"
                hold("lazy_pages_ended", daemon_pid=self.proc.pid)
                try:
                    kill_tree()  # before the references go: its faults wait until then
                except Exception:  # noqa: BLE001 - the tree may be gone already
                    log.exception("lazy restore: ending tree after daemon failure")
            self.resident_s = round(time.monotonic() - self.started, 6)
            self._release()
            # published last: whoever sees the stream ended finds its references gone
            self.error, self.state = error, state
            on_end(self)

        threading.Thread(target=run, name=f"lazy-pages-{self.proc.pid}", daemon=True).start()

    def abort(self) -> None:
        """The restore failed: stop the daemon and let go of everything."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.state = "failed"
        self._release()

    def _release(self) -> None:
        if self.source is not None:
            self.source.close()
        with self._lock:
            held, self._held = self._held, []
        for fd in held:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        self._kept.close()

    def report(self) -> dict[str, Any]:
        return {"state": self.state, "daemon_pid": self.proc.pid, "error": self.error,
                "resident_s": self.resident_s}


def end_waiting_daemon(staging_fd: int) -> bool:
    """A leftover staging dir of a helper that died mid-restore (paths.py removes them as the
    next one starts): a page daemon that still waits there for its restore, which never came
    (CRIU was killed with the old helper before it connected), is told to give up; else it
    would listen on its socket for ever. It accepts one connection and then reads the
    restore's userfaultfds from it: a connection that closes at once makes it exit. A
    daemon that already has its restore has closed its socket (the connection is refused)
    and serves on. True if a daemon was waiting. (The socket is connected to through a
    descriptor of it, opened without following a link: a name swapped meanwhile for a
    link to some other socket is not connected to as root.)"""
    try:
        fd = os.open(SOCKET, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=staging_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sk:
            sk.settimeout(1.0)  # (a full backlog would block a connect)
            try:
                sk.connect(f"/proc/self/fd/{fd}")
            except OSError:
                return False
        return True
    finally:
        os.close(fd)


_NOT_SERVED = {2, 6, 0x80, "DEAD", "Dead", "dead", "ZOMBIE", "Zombie", "zombie",
               "HELPER", "Helper", "helper"}


def processes_to_serve(criu: Any, dir_fd: int) -> int:
    """How many userfaultfds a lazy restore of these images hands the daemon: one per
    process that comes back alive (a zombie or a CRIU helper task sends none)."""
    count = 0
    for task in tree_tasks(criu, dir_fd):
        core = criu.load_image(dir_fd, f"core-{task['pid']}.img").get("entries", [{}])[0]
        if core.get("tc", {}).get("task_state") not in _NOT_SERVED:
            count += 1
    return count
