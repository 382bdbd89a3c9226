"""Blocking client of the privileged helper (``infinijup_helper``; contract: docs/protocol.md).

One connection per call: calls are few and long (a dump can take minutes on a GPU), so a
connection pool would buy nothing and would need recovery logic when the helper restarts.
Errors are raised as :mod:`infinijup.errors` classes carrying the helper's ``reason``.

This module imports only the standard library and ``infinijup.errors``: no Tornado, no Jupyter
server, no IPython, and nothing from the helper package (it may not be installed here).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest, HelperError, HelperUnavailable, PermissionDenied

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/infinijup/helper.sock"
START_COMMAND = "sudo make helper"
MAX_REPLY_BYTES = 16 * 1024 * 1024

ProgressCallback = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class HelperInfo:
    version: int
    criu_version: str
    uid: int
    work_dir: str
    features: Mapping[str, bool]
    arena_dir: str | None = None  # this user's directory in the helper's GPU arena


@dataclass(frozen=True)
class DumpResult:
    image_bytes: int
    duration_s: float
    phases: Mapping[str, float]
    gpu: Mapping[str, Any] | None = None  # devices, VRAM bytes, fingerprint (GPU kernels only)


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    duration_s: float
    phases: Mapping[str, float]
    gpu: Mapping[str, Any] | None = None
    pages: Mapping[str, Any] | None = None  # a lazy restore's page stream (see status)
    whole_why: str | None = None  # asked for lazy, restored whole: why


@dataclass(frozen=True)
class ProcessStatus:
    alive: bool
    exit_code: int | None  # negative: killed by that signal; None: unknown or still running
    # a lazily restored tree's memory: state "streaming", "resident" or "failed" (error: why),
    # resident_s (restore start to all memory back), daemon_pid; None: restored whole
    pages: Mapping[str, Any] | None = None


def default_socket_path() -> str:
    return os.environ.get("INFINIJUP_HELPER_SOCKET") or DEFAULT_SOCKET


def _error_for(reason: str, message: str) -> HelperError | BadRequest | PermissionDenied:
    if reason == "permission_denied":
        return PermissionDenied(message, reason=reason)
    if reason in ("bad_request", "bad_path"):
        return BadRequest(message, reason=reason)
    return HelperError(message, reason=reason)


class HelperClient:
    """Talks to the helper over its unix socket; every method is one request."""

    _ids = itertools.count(1)

    def __init__(self, socket_path: str | None = None, timeout: float | None = None) -> None:
        """``timeout`` bounds each wait for a reply line (None: wait as long as the op takes)."""
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout

    # --- ops ----------------------------------------------------------------------------------

    def hello(self) -> HelperInfo:
        r = self.call("hello", {})
        return HelperInfo(
            version=r["version"],
            criu_version=r["criu_version"],
            uid=r["uid"],
            work_dir=r["work_dir"],
            features=dict(r.get("features", {})),
            arena_dir=r.get("arena_dir"),
        )

    def work_dir(self) -> str:
        """This user's work dir on the helper side (created on first use)."""
        return self.hello().work_dir

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str) -> int:
        """Start ``argv`` in a new PID namespace as the calling user; return the tree root's
        host pid (the namespace's init, which forwards signals to ``argv``)."""
        r = self.call(
            "spawn", {"argv": list(argv), "env": dict(env), "cwd": cwd, "log_path": log_path}
        )
        return int(r["pid"])

    def dump(
        self,
        pid: int,
        images_dir: str,
        leave_running: bool = True,
        on_progress: ProgressCallback | None = None,
    ) -> DumpResult:
        r = self.call(
            "dump",
            {"pid": pid, "images_dir": images_dir, "leave_running": leave_running},
            on_progress,
        )
        return DumpResult(r["image_bytes"], r["duration_s"], dict(r["phases"]), r.get("gpu"))

    def restore(
        self,
        images_dir: str,
        replace_pid: int | None = None,
        on_progress: ProgressCallback | None = None,
        gpu_map: Sequence[tuple[str, str]] = (),
        port_map: Sequence[tuple[int, int]] = (),
        log_path: str | None = None,
        path_map: Sequence[tuple[str, str]] = (),
        lazy: bool = False,
        page_source: str | None = None,
        park: bool = False,
    ) -> RestoreResult:
        """``path_map`` (saved socket path, new path), ``port_map`` (saved TCP port, new port)
        and ``log_path`` restore the images into another kernel session: its endpoints and its
        log (see infinijup_helper/retarget.py)."""
        args: dict[str, Any] = {"images_dir": images_dir, "replace_pid": replace_pid}
        if gpu_map:
            args["gpu_map"] = [list(p) for p in gpu_map]
        if port_map:
            args["port_map"] = [list(p) for p in port_map]
        if path_map:
            args["path_map"] = [list(p) for p in path_map]
        if log_path is not None:
            args["log_path"] = log_path
        if lazy:
            args["lazy"] = True
        if page_source is not None:
            args["page_source"] = page_source
        if park:
            args["park"] = True
        r = self.call("restore", args, on_progress)
        return RestoreResult(int(r["pid"]), r["duration_s"], dict(r["phases"]), r.get("gpu"),
                             r.get("pages"), r.get("whole_why"))

    def gpu(self, pid: int, action: str) -> dict[str, Any]:
        """``action`` "release": move the tree's VRAM to host memory and free the GPU, the
        processes stay alive (CUDA calls block until "reacquire" brings it back)."""
        return self.call("gpu", {"pid": pid, "action": action})

    def kill(self, pid: int) -> None:
        """Kill the whole tree rooted at ``pid``; returns once it is gone."""
        self.call("kill", {"pid": pid})

    def signal(self, pid: int, signum: int) -> None:
        """Send ``signum`` (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 or SIGQUIT) to the tree
        rooted at ``pid``; its init forwards it to the kernel. Use this rather than
        ``os.kill``: root's tree inits run as root, and this works for every caller."""
        self.call("signal", {"pid": pid, "signum": int(signum)})

    def release(self, path: str) -> None:
        """Remove a file or directory inside the work dir (absent is fine)."""
        self.call("release", {"path": path})

    def status(self, pid: int) -> ProcessStatus:
        r = self.call("status", {"pid": pid})
        return ProcessStatus(bool(r["alive"]), r["exit_code"], r.get("pages"))

    def trees(self) -> list[int]:
        """Root pids of the caller's live kernel trees, as the helper recorded them when it
        spawned or restored them (also across a helper restart)."""
        return [int(t["pid"]) for t in self.call("trees", {})["trees"]]

    # --- transport ----------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise HelperUnavailable(
                f"the Infinijup helper is not running (cannot connect to {self.socket_path}: "
                f"{exc.strerror}); start it with: {START_COMMAND}"
            ) from None
        except OSError as exc:
            sock.close()
            raise HelperUnavailable(
                f"cannot connect to the Infinijup helper at {self.socket_path}: {exc.strerror}; "
                f"is it running? start it with: {START_COMMAND}"
            ) from None
        return sock

    def call(
        self, op: str, args: Mapping[str, Any], on_progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        """Send one request and return its ``result``; progress events go to ``on_progress``."""
        rid = next(self._ids)
        line = json.dumps({"v": PROTOCOL_VERSION, "id": rid, "op": op, "args": dict(args)})
        sock = self._connect()
        try:
            with sock, sock.makefile("rb") as replies:
                try:
                    sock.sendall(line.encode() + b"\n")
                except OSError as exc:
                    raise HelperError(
                        f"lost the helper while sending {op}: {exc}", reason="helper_disconnected"
                    ) from None
                while True:
                    message = self._read_message(replies, op)
                    if message.get("id") not in (rid, None):
                        continue  # not ours (cannot happen on a private connection)
                    if message.get("event") == "progress":
                        if on_progress is not None:
                            on_progress(str(message.get("phase")), message.get("detail") or {})
                        continue
                    if message.get("ok") is True:
                        return dict(message.get("result") or {})
                    error = message.get("error") or {}
                    raise _error_for(
                        str(error.get("reason", "helper_error")),
                        str(error.get("message", "the helper reported an error")),
                    )
        except TimeoutError:
            raise HelperError(
                f"the helper did not answer {op} within {self.timeout} s", reason="timeout"
            ) from None

    @staticmethod
    def _read_message(replies: Any, op: str) -> dict[str, Any]:
        try:
            raw = replies.readline(MAX_REPLY_BYTES)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raw = b""
            detail = str(exc)
        else:
            detail = "connection closed"
        if not raw.endswith(b"\n"):
            raise HelperError(
                f"the helper closed the connection before answering {op} ({detail}); "
                "it may have crashed or restarted",
                reason="helper_disconnected",
            )
        try:
            message = json.loads(raw)
        except ValueError:
            raise HelperError("the helper sent an unreadable reply", reason="bad_reply") from None
        if not isinstance(message, dict):
            raise HelperError("the helper sent an unreadable reply", reason="bad_reply")
        return message
