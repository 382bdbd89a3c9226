"""The unix-socket server: one thread per connection, requests one after another on each.

Threads rather than asyncio because every op is a blocking call (CRIU, waitpid, file copies)
and ops on different kernels must overlap. The server's one promise is that nothing a client
does — garbage, a huge line, hanging up mid-op — reaches further than that client's own
connection: every failure becomes an error reply or a closed connection, and an op whose
client has gone still runs to completion (a half-done dump would leave a frozen kernel).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import protocol as p
from .ops import Operations
from .proc import Caller
from .protocol import RequestError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 128
IDLE_TIMEOUT_S = 600.0
_PEERCRED = struct.Struct("3i")


def peer_caller(conn: socket.socket) -> Caller:
    pid, uid, gid = _PEERCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return Caller(pid=pid, uid=uid, gid=gid)


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
                self._conn.sendall(data)
            except OSError:
                self.alive = False


class HelperServer:
    def __init__(self, socket_path: str, ops: Operations) -> None:
        self.socket_path = socket_path
        self.ops = ops
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    # --- lifecycle ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Listen on the socket path (a stale socket file from a dead helper is replaced)."""
        directory = os.path.dirname(self.socket_path)
        if directory and not os.path.isdir(directory):
            os.makedirs(directory, mode=0o755, exist_ok=True)
            os.chmod(directory, 0o755)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        # Anyone may connect: every request is authorized by the peer's kernel credentials.
        os.chmod(self.socket_path, 0o666)
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
            if not self._slots.acquire(blocking=False):
                _Replies(conn).send(p.error_response(None, "busy", "too many connections"))
                conn.close()
                continue
            threading.Thread(
                target=self._serve_connection, args=(conn,), name="conn", daemon=True
            ).start()

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

    def _serve_connection(self, conn: socket.socket) -> None:
        replies = _Replies(conn)
        try:
            caller = peer_caller(conn)
            conn.settimeout(IDLE_TIMEOUT_S)
            with conn.makefile("rb") as stream:
                while replies.alive:
                    try:
                        line = p.read_line(stream)
                    except p.RequestTooLarge as exc:
                        replies.send(p.error_response(None, exc.reason, exc.message))
                        return  # the rest of that line cannot be told from a next request
                    if line is None:
                        return
                    self._serve_request(caller, line, replies)
        except OSError:
            return  # reset, timeout: the client is gone
        except Exception:  # noqa: BLE001 - a bug here must not take the helper down
            log.exception("connection handler failed")
        finally:
            conn.close()
            self._slots.release()

    def _serve_request(self, caller: Caller, line: bytes, replies: _Replies) -> None:
        try:
            request = p.parse_request(line)
        except RequestError as exc:
            replies.send(p.error_response(exc.request_id, exc.reason, exc.message))
            return

        def progress(phase: str, detail: Mapping[str, Any]) -> None:
            replies.send(p.progress_event(request.id, phase, detail))

        start = time.monotonic()
        try:
            result = self.ops.handle(caller, request, progress)
            reply = p.ok_response(request.id, result)
            outcome = "ok"
        except RequestError as exc:
            reply = p.error_response(request.id, exc.reason, exc.message)
            outcome = exc.reason
        except Exception as exc:  # noqa: BLE001 - report, log, keep serving
            log.exception("op %s failed unexpectedly", request.op)
            reply = p.error_response(request.id, "internal_error", f"{type(exc).__name__}: {exc}")
            outcome = "internal_error"
        log.info(
            "uid=%d pid=%d op=%s -> %s (%.3f s)",
            caller.uid,
            caller.pid,
            request.op,
            outcome,
            time.monotonic() - start,
        )
        replies.send(reply)
