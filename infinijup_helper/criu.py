"""CRIU through its RPC interface (pycriu), and checks on the images it writes and reads.

The helper starts ``criu swrk FD`` itself with ``subprocess`` and hands pycriu the other end of
the socket (``use_fd``), instead of ``use_binary``: pycriu's own launcher forks the helper with
``os.fork`` (unsafe in a threaded process) and waits for CRIU with ``waitpid``, which the
helper's reaper must never race with.

Options are fixed here, one set for dump and one for restore; nothing a client sends can add
to them.

CRIU requests run one at a time, helper-wide: two dumps of different PID-namespaced trees that
share a mount namespace collide inside CRIU (its parasite creates a fixed-name directory to
mount a /proc for the target's namespace, and the second one fails with EEXIST). Everything
outside the CRIU call itself (staging, sealing, GPU stages later) still runs concurrently.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .holds import criu_notifications_wanted, hold
from .protocol import RequestError

log = logging.getLogger(__name__)

DUMP_LOG = "criu.log"
RESTORE_LOG = "restore.log"
LOG_LEVEL = 4
LOG_TAIL_LINES = 30


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


def log_tail(dir_fd: int, name: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a CRIU log, errors first, for an error message a person can act on."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return "(no CRIU log)"
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - 64 * 1024), os.SEEK_SET)
        text = os.read(fd, 64 * 1024).decode(errors="replace")
    finally:
        os.close(fd)
    all_lines = text.splitlines()
    errors = [ln for ln in all_lines if "Error" in ln or "error" in ln][-10:]
    tail = all_lines[-lines:]
    picked = errors + [ln for ln in tail if ln not in errors]
    return "\n".join(picked)


@dataclass(frozen=True)
class CriuSettings:
    binary: str
    pycriu_path: str | None


class Criu:
    """Runs single CRIU requests, each in its own ``criu swrk`` process."""

    def __init__(self, settings: CriuSettings) -> None:
        self.binary = settings.binary
        self.pycriu = load_pycriu(settings.pycriu_path)
        self.version = criu_version(self.binary)
        self._one_at_a_time = threading.Lock()

    def _request(self, images_fd: int, log_name: str, kind: str, configure: Any) -> Any:
        with self._one_at_a_time:
            return self._request_now(images_fd, log_name, kind, configure)

    def _request_now(self, images_fd: int, log_name: str, kind: str, configure: Any) -> Any:
        pycriu = self.pycriu
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            swrk = subprocess.Popen(
                [self.binary, "swrk", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                cwd="/",
            )
        finally:
            theirs.close()
        try:
            client = pycriu.criu()
            client.use_fd(ours.fileno())
            opts = client.opts
            opts.images_dir_fd = images_fd
            opts.log_file = log_name
            opts.log_level = LOG_LEVEL
            configure(opts)
            hold(f"criu_{kind}_request", criu_pid=swrk.pid)
            try:
                if criu_notifications_wanted(kind):
                    resp = self._call_with_holds(ours, opts, kind, swrk.pid)
                else:
                    resp = client.dump() if kind == "dump" else client.restore()
            except pycriu.CRIUException as exc:
                raise CriuFailed(
                    f"CRIU {kind} failed: {exc}\n{log_tail(images_fd, log_name)}"
                ) from None
            hold(f"criu_{kind}_response", criu_pid=swrk.pid)
            return resp
        finally:
            ours.close()
            try:
                swrk.wait(timeout=30)
            except subprocess.TimeoutExpired:
                swrk.kill()
                swrk.wait()

    def _call_with_holds(self, sk: socket.socket, opts: Any, kind: str, criu_pid: int) -> Any:
        """pycriu's request and answer, with CRIU's notifications turned on and each one a
        hold point (tests only: see holds.py)."""
        rpc = self.pycriu.rpc
        req = rpc.criu_req(type=rpc.DUMP if kind == "dump" else rpc.RESTORE)
        req.opts.MergeFrom(opts)
        req.opts.notify_scripts = True
        try:
            sk.send(req.SerializeToString())
            while True:
                resp = rpc.criu_resp()
                resp.ParseFromString(sk.recv(len(sk.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK))))
                if resp.type != rpc.NOTIFY:
                    break
                hold(f"criu_{kind}_{resp.notify.script}", criu_pid=criu_pid, pid=resp.notify.pid)
                sk.send(rpc.criu_req(type=rpc.NOTIFY, notify_success=True).SerializeToString())
        except OSError as exc:
            raise self.pycriu.CRIUExceptionInternal(req.type, str(exc)) from None
        if not resp.success:
            raise self.pycriu.CRIUExceptionExternal(req.type, resp.type, resp.cr_errno)
        return resp.dump if kind == "dump" else resp.restore

    def dump(self, pid: int, images_fd: int, *, leave_running: bool) -> None:
        """Dump the tree rooted at ``pid``. On failure CRIU resumes the tree."""

        def configure(opts: Any) -> None:
            opts.pid = pid
            opts.leave_running = leave_running
            opts.tcp_established = True
            # A client connecting while the tree is frozen leaves a connection not yet
            # accepted ("in flight"); without this the dump fails on it. Left out, the client
            # sees a reset and reconnects (ZMQ does).
            opts.tcp_skip_in_flight = True
            opts.network_lock = self.pycriu.rpc.SKIP  # no iptables/nft needed; see FINDINGS
            opts.file_locks = True

        self._request(images_fd, DUMP_LOG, "dump", configure)

    def restore(self, images_fd: int) -> int:
        """Restore a tree as a child of the helper; return the root's host pid."""

        def configure(opts: Any) -> None:
            # Connections of snapshot time have no live peer any more (and restoring them
            # established would clash with the live 4-tuples of a branch restored beside it):
            # they come back closed, and the clients reconnect to the restored listeners.
            opts.tcp_close = True
            opts.rst_sibling = True
            opts.file_locks = True

        resp = self._request(images_fd, RESTORE_LOG, "restore", configure)
        return int(resp.pid)

    # --- image inspection -------------------------------------------------------------------

    def load_image(self, dir_fd: int, name: str) -> dict[str, Any]:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            try:
                return self.pycriu.images.load(f)
            except Exception as exc:  # noqa: BLE001 - any decode failure means damaged images
                raise RequestError("bad_request", f"image {name} cannot be read: {exc}") from None


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
        header = criu.load_image(dir_fd, name).get("entries", [{}])[0]
        if "pages_id" in header:
            (root_pages if index == 0 else below).add(f"pages-{header['pages_id']}.img")
    return below - root_pages


PE_PARENT = 1  # pagemap entry flags (CRIU images/pagemap.proto)
PE_PRESENT = 4


def check_page_files(criu: Criu, dir_fd: int) -> None:
    """Refuse images whose page files do not hold exactly the pages their pagemaps list.

    CRIU itself does not stop on a short page file: restoring one spun at 100% CPU for good
    (CRIU 4.2.1), after the kernel being replaced was already gone. Checked before that.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    names = set(image_names(dir_fd))
    for name in sorted(n for n in names if n.startswith("pagemap") and n.endswith(".img")):
        entries = criu.load_image(dir_fd, name).get("entries", [])
        if not entries or "pages_id" not in entries[0]:
            raise RequestError("bad_request", f"damaged images: {name} has no header")
        pages = f"pages-{entries[0]['pages_id']}.img"
        want = page * sum(int(e.get("nr_pages", 0)) for e in entries[1:]
                          if int(e.get("flags", 0)) & PE_PRESENT
                          and not int(e.get("flags", 0)) & PE_PARENT)
        have = os.stat(pages, dir_fd=dir_fd, follow_symlinks=False).st_size \
            if pages in names else None
        if (have or 0) != want:
            raise RequestError(
                "bad_request", f"damaged images: {pages} holds "
                f"{'nothing' if have is None else f'{have} bytes'}, {name} lists {want}")


def _creds_problem(creds: dict[str, Any] | None, uid: int, allowed: set[int]) -> str | None:
    if creds is None:
        return "carries no credentials"
    uids = [creds.get(k) for k in ("uid", "euid", "suid", "fsuid")]
    gid_fields = [creds.get(k) for k in ("gid", "egid", "sgid", "fsgid")]
    groups = list(creds.get("groups", []))
    caps = [c for k in ("cap_inh", "cap_prm", "cap_eff", "cap_amb") for c in creds.get(k, [])]
    if any(u != uid for u in uids):
        return f"runs as uid(s) {uids}, not {uid}"
    if any(g not in allowed for g in gid_fields + groups):
        return f"has groups outside uid {uid}'s"
    if any(caps) and uid != 0:
        return "holds capabilities"
    return None


def check_creds(criu: Criu, dir_fd: int, uid: int, gids: Iterable[int]) -> int:
    """Refuse images with any process below the tree root whose credentials are not the
    caller's: every uid field equals ``uid``, every gid field and supplementary group is one
    of ``gids``, no capability held (a process of an ordinary user has none).

    The tree root itself may also be root: the helper's nsinit runs as root (see nsinit.py).
    Such images are only accepted with a valid seal naming the caller as their owner, and the
    root's memory is sealed by hash, so its code cannot be changed in between.
    Returns the number of threads checked; there must be at least one below the root.
    """
    allowed = set(gids)
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
            problem = _creds_problem(creds, uid, allowed)
            if problem and index == 0 and creds is not None:
                if all(creds.get(k) == 0 for k in ("uid", "euid", "suid", "fsuid")):
                    problem = None  # the root-owned nsinit
            if problem:
                raise RequestError("permission_denied", f"process {task['pid']} ({name}) {problem}")
            checked_below += index > 0
    if checked_below == 0:
        raise RequestError("bad_request", "the images hold no process below the tree's init")
    return checked_below
