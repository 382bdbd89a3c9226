"""The unix-socket server: one thread per connection, requests one after another on each.

Threads rather than asyncio because every op is a blocking call (CRIU, waitpid, file copies)
and ops on different kernels must overlap. The server's one promise is that nothing a client
does — garbage, a huge line, hanging up mid-op, holding connections open, trickling bytes —
reaches further than that client's own share: every failure becomes an error reply or a closed
connection, each user has a bounded number of connections and running operations (limits.py),
and an op whose client has gone still runs to completion (a half-done dump would leave a
frozen kernel).
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import protocol as p
from .holds import hold
from .limits import Limits, read_caller_context
from .ops import Operations
from .proc import Caller
from .protocol import RequestError

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5
CHEAP_OPS = frozenset({"hello", "status", "trees"})  # not counted against a user's op limit


def peer_caller(conn: socket.socket) -> Caller:
    pid, uid, gid = _PEERCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pidfd = None  # older kernel: limits.py falls back to pidfd_open(pid)
    return Caller(pid=pid, uid=uid, gid=gid, pidfd=pidfd)


class RequestTimeout(Exception):
    """A request line did not arrive whole within its deadline."""


class LineReader:
    """Request lines off a socket: an idle timeout until a request starts, then a deadline for
    the whole line, so a client trickling bytes holds its connection for bounded time."""

    def __init__(self, conn: socket.socket, limits: Limits) -> None:
        self._conn = conn
        self._limits = limits
        self._buf = bytearray()

    def read(self) -> bytes | None:
        """One line without its newline; None at a clean end of stream or when idle too long.
        Raises :class:`p.RequestTooLarge` or :class:`RequestTimeout`."""
        deadline = None
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 1]
                if len(line) > p.MAX_LINE_BYTES:
                    raise p.RequestTooLarge()
                return line
            if len(self._buf) > p.MAX_LINE_BYTES:
                raise p.RequestTooLarge()
            if self._buf and deadline is None:
                deadline = time.monotonic() + self._limits.request_timeout_s
            if deadline is None:
                self._conn.settimeout(self._limits.idle_timeout_s)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout()
                self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(1 << 16)
            except TimeoutError:
                if deadline is None:
                    return None  # idle: close quietly
                raise RequestTimeout() from None
            if not chunk:
                if self._buf:  # last line without a newline: the client half-closed
                    line = bytes(self._buf)
                    self._buf.clear()
                    return line
                return None
            self._buf += chunk


class _Counter:
    """How many of something each uid holds (connections, running ops)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}

    def try_take(self, uid: int, limit: int | None) -> bool:
        with self._lock:
            count = self._counts.get(uid, 0)
            if limit is not None and count >= limit:
                return False
            self._counts[uid] = count + 1
            return True

    def give_back(self, uid: int) -> None:
        with self._lock:
            count = self._counts.get(uid, 0) - 1
            if count <= 0:
                self._counts.pop(uid, None)
            else:
                self._counts[uid] = count

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class _Replies:
    """Writes reply lines; once the client is gone it silently drops the rest."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.alive = True

    def send(self, message: Mapping[str, Any]) -> None:
        if not self.alive:
            return
        data = p.encode(message)
        with self._lock:
            try:
                # a client that stops reading must not block an op's thread for ever
                self._conn.settimeout(SEND_TIMEOUT_S)
                self._conn.sendall(data)
            except OSError:
                self.alive = False


SEND_TIMEOUT_S = 60.0


class HelperServer:
    def __init__(self, socket_path: str, ops: Operations, limits: Limits | None = None) -> None:
        self.socket_path = socket_path
        self.ops = ops
        self.limits = limits or ops.limits
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()
        self._connections = _Counter()
        self._running = _Counter()

    # --- lifecycle ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Listen on the socket path (a stale socket file from a dead helper is replaced).

        The directory must be root's and writable by nobody else, so nobody can swap the path
        under us; the socket is created with its mode (umask), never chmod-ed by path.
        """
        directory = os.path.dirname(self.socket_path) or "/"
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o755, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise RuntimeError(f"{directory} must be a directory owned by root and writable by "
                               "nobody else (the helper's socket lives there)")
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Anyone may connect: every request is authorized by the peer's kernel credentials.
        old = os.umask(0o111)
        try:
            sock.bind(self.socket_path)
        finally:
            os.umask(old)
        sock.listen(64)
        self._sock = sock

    def serve_forever(self) -> None:
        assert self._sock is not None, "bind() first"
        log.info("serving on %s", self.socket_path)
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    break
                log.warning("accept failed: %s", exc)
                time.sleep(0.1)  # e.g. EMFILE: do not spin
                continue
            try:
                caller = peer_caller(conn)
            except OSError:
                conn.close()
                continue
            refusal = self._admit(caller)
            if refusal is not None:
                _Replies(conn).send(p.error_response(None, "busy", refusal))
                _close_caller(caller)
                conn.close()
                continue
            threading.Thread(
                target=self._serve_connection, args=(conn, caller), name="conn", daemon=True
            ).start()

    def _admit(self, caller: Caller) -> str | None:
        """Why this connection is refused, or None (the slot is then taken)."""
        if self._connections.total() >= self.limits.max_connections:
            return f"too many connections ({self.limits.max_connections})"
        per_user = None if caller.is_root else self.limits.connections_per_user
        if not self._connections.try_take(caller.uid, per_user):
            return (f"uid {caller.uid} already has {per_user} connections open, the most one "
                    "user may have")
        return None

    def shutdown(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    # --- one connection -----------------------------------------------------------------------

    def _serve_connection(self, conn: socket.socket, caller: Caller) -> None:
        replies = _Replies(conn)
        try:
            # What its kernels inherit from the caller (cgroup, resource limits): read now,
            # through its pidfd, once; a process the socket is handed to later changes nothing.
            hold("connection_accepted", pid=caller.pid)
            caller = read_caller_context(caller)
            reader = LineReader(conn, self.limits)
            while replies.alive:
                try:
                    line = reader.read()
                except p.RequestTooLarge as exc:
                    replies.send(p.error_response(None, exc.reason, exc.message))
                    return  # the rest of that line cannot be told from a next request
                except RequestTimeout:
                    replies.send(p.error_response(
                        None, "request_timeout",
                        f"a request line must arrive whole within "
                        f"{self.limits.request_timeout_s:.0f} s"))
                    return
                if line is None:
                    return
                self._serve_request(caller, line, replies)
        except OSError:
            return  # reset: the client is gone
        except Exception:  # noqa: BLE001 - a bug here must not take the helper down
            log.exception("connection handler failed")
        finally:
            conn.close()
            self._connections.give_back(caller.uid)
            _close_caller(caller)

    def _serve_request(self, caller: Caller, line: bytes, replies: _Replies) -> None:
        try:
            request = p.parse_request(line)
        except RequestError as exc:
            replies.send(p.error_response(exc.request_id, exc.reason, exc.message))
            return

        def progress(phase: str, detail: Mapping[str, Any]) -> None:
            replies.send(p.progress_event(request.id, phase, detail))

        counted = request.op not in CHEAP_OPS
        per_user = None if caller.is_root else self.limits.ops_per_user
        if counted and not self._running.try_take(caller.uid, per_user):
            replies.send(p.error_response(
                request.id, "busy",
                f"uid {caller.uid} already runs {per_user} operations, the most one user may "
                "run at once; retry when one has finished"))
            return
        start = time.monotonic()
        try:
            result = self.ops.handle(caller, request, progress)
            reply = p.ok_response(request.id, result)
            outcome = "ok"
        except RequestError as exc:
            reply = p.error_response(request.id, exc.reason, exc.message)
            outcome = exc.reason
            if exc.reason == "criu_failed":  # why, for whoever reads the helper's log
                log.warning("uid=%d op=%s: %s", caller.uid, request.op, exc.message)
        except Exception as exc:  # noqa: BLE001 - report, log, keep serving
            log.exception("op %s failed unexpectedly", request.op)
            reply = p.error_response(request.id, "internal_error", f"{type(exc).__name__}: {exc}")
            outcome = "internal_error"
        finally:
            if counted:
                self._running.give_back(caller.uid)
        log.info(
            "uid=%d pid=%d op=%s -> %s (%.3f s)",
            caller.uid,
            caller.pid,
            request.op,
            outcome,
            time.monotonic() - start,
        )
        replies.send(reply)


def _close_caller(caller: Caller) -> None:
    if caller.pidfd is not None:
        try:
            os.close(caller.pidfd)
        except OSError:
            pass
