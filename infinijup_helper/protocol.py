"""The helper's wire protocol: framing, request parsing and validation (docs/protocol.md).

Everything a client sends passes through :func:`parse_request` before any other code sees it, so
the rest of the helper only ever handles well-typed, bounded values. There is deliberately no
"extra options" escape hatch: each op accepts exactly the arguments listed in ``ARG_SPECS``.
"""

from __future__ import annotations

import json
import math
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

VERSION = 1
MAX_LINE_BYTES = 1024 * 1024
MAX_PATH_CHARS = 4096
MAX_ARGV_ITEMS = 4096
MAX_ENV_ITEMS = 4096
MAX_PID = 4_194_304  # the kernel's PID_MAX_LIMIT on 64-bit
MAX_ID = 2**53  # ids round-trip through JavaScript clients too


class RequestError(Exception):
    """A request the helper refuses; ``reason`` is the stable code sent back to the client."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.request_id: int | None = None

    @property
    def message(self) -> str:
        return str(self)


class RequestTooLarge(RequestError):
    """The line exceeded :data:`MAX_LINE_BYTES`; the connection cannot be resynchronised."""

    def __init__(self) -> None:
        super().__init__("request_too_large", f"request line exceeds {MAX_LINE_BYTES} bytes")


# ---------------------------------------------------------------------------------------------
# Typed arguments, one frozen dataclass per op


@dataclass(frozen=True)
class HelloArgs:
    pass


@dataclass(frozen=True)
class SpawnArgs:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    log_path: str


@dataclass(frozen=True)
class DumpArgs:
    pid: int
    images_dir: str
    leave_running: bool = True


@dataclass(frozen=True)
class RestoreArgs:
    images_dir: str
    replace_pid: int | None = None
    gpu_map: tuple[tuple[str, str], ...] = ()  # (saved GPU UUID, GPU UUID to restore onto)
    # Restoring into another kernel session (see retarget.py): its TCP ports (saved -> new),
    # its unix socket paths (saved -> new: kernels listen on ZMQ ipc endpoints) and its log
    # file, which replaces the log of the kernel that was dumped.
    port_map: tuple[tuple[int, int], ...] = ()
    path_map: tuple[tuple[str, str], ...] = ()
    log_path: str | None = None
    lazy: bool = False  # run before the memory is back (lazy_pages.py)
    # A unix socket in images_dir that serves the page files, which are then not in it
    # (page_source.py): restores from the store without checking the pages out.
    page_source: str | None = None
    # Set the replaced tree aside instead of ending it (an undo: it is dumped afterwards); its
    # connections end, its listeners stay. Refused ("cannot_park") where the restore would
    # need what it holds: KillReplaced.
    park: bool = False


@dataclass(frozen=True)
class KillArgs:
    pid: int


@dataclass(frozen=True)
class ReleaseArgs:
    path: str


@dataclass(frozen=True)
class StatusArgs:
    pid: int


@dataclass(frozen=True)
class SignalArgs:
    pid: int
    signum: int


@dataclass(frozen=True)
class TreesArgs:
    pass


@dataclass(frozen=True)
class GpuArgs:
    pid: int
    action: str  # "release": VRAM to host memory, GPU freed; "reacquire": back onto the GPU


OpArgs = (
    HelloArgs
    | SpawnArgs
    | DumpArgs
    | RestoreArgs
    | KillArgs
    | ReleaseArgs
    | StatusArgs
    | SignalArgs
    | GpuArgs
    | TreesArgs
)

# What a tree's nsinit forwards to the kernel (SIGKILL is the `kill` op).
SIGNALS = {
    signal.SIGHUP: "SIGHUP",
    signal.SIGINT: "SIGINT",
    signal.SIGQUIT: "SIGQUIT",
    signal.SIGUSR1: "SIGUSR1",
    signal.SIGUSR2: "SIGUSR2",
    signal.SIGTERM: "SIGTERM",
}


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    args: OpArgs = field(default_factory=HelloArgs)


# ---------------------------------------------------------------------------------------------
# Field validators: each takes (name, raw value) and returns the typed value or raises


def _fail(name: str, what: str) -> RequestError:
    return RequestError("bad_request", f"argument {name!r} must be {what}")


def _check_text(name: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise _fail(name, f"at most {limit} characters")
    if "\x00" in value:
        raise _fail(name, "free of NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(name, "valid Unicode (no lone surrogates)") from None
    return value


def _pid(name: str, value: Any) -> int:
    if type(value) is not int or not 1 <= value <= MAX_PID:
        raise _fail(name, f"an integer pid between 1 and {MAX_PID}")
    return value


def _optional_pid(name: str, value: Any) -> int | None:
    return None if value is None else _pid(name, value)


def _signum(name: str, value: Any) -> int:
    if type(value) is not int or value not in SIGNALS:
        allowed = ", ".join(f"{int(n)} ({v})" for n, v in sorted(SIGNALS.items()))
        raise _fail(name, f"one of {allowed}")
    return value


GPU_ACTIONS = ("release", "reacquire")


def _gpu_action(name: str, value: Any) -> str:
    if value not in GPU_ACTIONS:
        raise _fail(name, " or ".join(repr(a) for a in GPU_ACTIONS))
    return value


def _bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise _fail(name, "true or false")
    return value


def _optional_name(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or "/" in value or value in (".", ".."):
        raise _fail(name, "a file name (no slash)")
    return _check_text(name, value, 64)


def _path(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(name, "a non-empty string")
    return _check_text(name, value, MAX_PATH_CHARS)


_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def _gpu_map(name: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise _fail(name, "a list of at most 64 [saved GPU UUID, target GPU UUID] pairs")
    pairs = []
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(u, str) and _GPU_UUID.match(u) for u in pair)):
            raise _fail(name, "pairs of GPU UUIDs like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


MAX_PORT_PAIRS = 64


def _port_map(name: str, value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or len(value) > MAX_PORT_PAIRS:
        raise _fail(name, f"a list of at most {MAX_PORT_PAIRS} [saved port, new port] pairs")
    pairs = []
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(type(p) is int and 1 <= p <= 65535 for p in pair)):
            raise _fail(name, "pairs of TCP ports between 1 and 65535")
        pairs.append((pair[0], pair[1]))
    if len({old for old, _ in pairs}) != len(pairs) or len({new for _, new in pairs}) != len(pairs):
        raise _fail(name, "pairs with distinct saved ports and distinct new ports")
    return tuple(pairs)


MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, one of them the final NUL


def _socket_path(name: str, value: Any) -> str:
    path = _path(name, value)
    if not path.startswith("/") or len(path.encode()) > MAX_SOCKET_PATH:
        raise _fail(name, f"absolute unix socket paths of at most {MAX_SOCKET_PATH} bytes")
    return path


def _path_map(name: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or len(value) > MAX_PORT_PAIRS:
        raise _fail(name, f"a list of at most {MAX_PORT_PAIRS} [saved path, new path] pairs")
    pairs = []
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(name, "pairs of unix socket paths")
        pairs.append((_socket_path(name, pair[0]), _socket_path(name, pair[1])))
    if len({old for old, _ in pairs}) != len(pairs) or len({new for _, new in pairs}) != len(pairs):
        raise _fail(name, "pairs with distinct saved paths and distinct new paths")
    return tuple(pairs)


def _optional_path(name: str, value: Any) -> str | None:
    return None if value is None else _path(name, value)


def _argv(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or len(value) > MAX_ARGV_ITEMS:
        raise _fail(name, f"a non-empty list of at most {MAX_ARGV_ITEMS} strings")
    out = []
    for item in value:
        if not isinstance(item, str):
            raise _fail(name, "a list of strings")
        out.append(_check_text(name, item, MAX_LINE_BYTES))
    if not out[0]:
        raise _fail(name, "a list whose first item (the program) is not empty")
    return tuple(out)


def _env(name: str, value: Any) -> Mapping[str, str]:
    if not isinstance(value, dict) or len(value) > MAX_ENV_ITEMS:
        raise _fail(name, f"an object of at most {MAX_ENV_ITEMS} string values")
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(item, str) or not key or "=" in key:
            raise _fail(name, "an object mapping non-empty names without '=' to strings")
        out[_check_text(name, key, MAX_PATH_CHARS)] = _check_text(name, item, MAX_LINE_BYTES)
    return out


Validator = Callable[[str, Any], Any]
_REQUIRED = object()

# op -> (dataclass, {arg name: (validator, default or _REQUIRED)})
ARG_SPECS: dict[str, tuple[type, dict[str, tuple[Validator, Any]]]] = {
    "hello": (HelloArgs, {}),
    "spawn": (
        SpawnArgs,
        {
            "argv": (_argv, _REQUIRED),
            "env": (_env, _REQUIRED),
            "cwd": (_path, _REQUIRED),
            "log_path": (_path, _REQUIRED),
        },
    ),
    "dump": (
        DumpArgs,
        {
            "pid": (_pid, _REQUIRED),
            "images_dir": (_path, _REQUIRED),
            "leave_running": (_bool, True),
        },
    ),
    "restore": (
        RestoreArgs,
        {
            "images_dir": (_path, _REQUIRED),
            "replace_pid": (_optional_pid, None),
            "gpu_map": (_gpu_map, ()),
            "port_map": (_port_map, ()),
            "path_map": (_path_map, ()),
            "log_path": (_optional_path, None),
            "lazy": (_bool, False),
            "page_source": (_optional_name, None),
            "park": (_bool, False),
        },
    ),
    "kill": (KillArgs, {"pid": (_pid, _REQUIRED)}),
    "release": (ReleaseArgs, {"path": (_path, _REQUIRED)}),
    "status": (StatusArgs, {"pid": (_pid, _REQUIRED)}),
    "signal": (SignalArgs, {"pid": (_pid, _REQUIRED), "signum": (_signum, _REQUIRED)}),
    "gpu": (GpuArgs, {"pid": (_pid, _REQUIRED), "action": (_gpu_action, _REQUIRED)}),
    "trees": (TreesArgs, {}),
}

OPS = frozenset(ARG_SPECS)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode(line: bytes) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("bad_request", "request is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise RequestError("bad_request", f"request is not valid JSON: {exc}") from None


def request_id_of(message: Any) -> int | None:
    """The id to answer with, when the message carries a usable one (even if it is invalid)."""
    if isinstance(message, dict):
        rid = message.get("id")
        if type(rid) is int and 0 <= rid <= MAX_ID:
            return rid
    return None


def parse_request(line: bytes) -> Request:
    """Turn one request line into a :class:`Request`, or raise :class:`RequestError`.

    Order of checks: size, JSON, object shape, version, id, op, arguments, so that a client
    speaking another version learns that first, before its arguments are judged. A raised
    error carries ``request_id`` (the message's id when it had a usable one) for the reply.
    """
    if len(line) > MAX_LINE_BYTES:
        raise RequestTooLarge()
    message = _decode(line)
    try:
        return _parse_message(message)
    except RequestError as exc:
        exc.request_id = request_id_of(message)
        raise


def _parse_message(message: Any) -> Request:
    if not isinstance(message, dict):
        raise RequestError("bad_request", "request must be a JSON object")
    version = message.get("v")
    if type(version) is not int or version != VERSION:
        shown = repr(version)[:40]
        raise RequestError(
            "protocol_version", f"this helper speaks protocol version {VERSION}, got {shown}"
        )
    rid = request_id_of(message)
    if rid is None:
        raise RequestError("bad_request", f"'id' must be an integer between 0 and {MAX_ID}")
    unknown_keys = set(message) - {"v", "id", "op", "args"}
    if unknown_keys:
        shown = sorted(k[:40] for k in unknown_keys)[:10]
        raise RequestError("bad_request", f"unknown request fields: {shown}")
    op = message.get("op")
    if not isinstance(op, str):
        raise RequestError("bad_request", "'op' must be a string")
    if op not in ARG_SPECS:
        shown = op if len(op) <= 64 else op[:64] + "..."
        raise RequestError("unknown_op", f"unknown op {shown!r}; known: {sorted(OPS)}")
    raw_args = message.get("args", {})
    if not isinstance(raw_args, dict):
        raise RequestError("bad_request", "'args' must be a JSON object")
    return Request(id=rid, op=op, args=_parse_args(op, raw_args))


def _parse_args(op: str, raw: dict[str, Any]) -> OpArgs:
    cls, spec = ARG_SPECS[op]
    unknown = set(raw) - set(spec)
    if unknown:
        shown = sorted(k[:40] for k in unknown)[:10]
        raise RequestError(
            "bad_request", f"op {op!r} takes no argument(s) {shown}; takes {sorted(spec)}"
        )
    values = {}
    for name, (validate, default) in spec.items():
        if name in raw:
            values[name] = validate(name, raw[name])
        elif default is _REQUIRED:
            raise RequestError("bad_request", f"op {op!r} needs argument {name!r}")
        else:
            values[name] = default
    return cls(**values)


# ---------------------------------------------------------------------------------------------
# Framing


def read_line(stream: BinaryIO) -> bytes | None:
    """One request line without its newline; ``None`` at a clean end of stream.

    Raises :class:`RequestTooLarge` as soon as more than :data:`MAX_LINE_BYTES` arrive without a
    newline, so a client cannot make the helper buffer unbounded input.
    """
    line = stream.readline(MAX_LINE_BYTES + 1)
    if not line:
        return None
    if line.endswith(b"\n"):
        return line[:-1]
    if len(line) > MAX_LINE_BYTES:
        raise RequestTooLarge()
    return line  # last line without a newline: the client half-closed after writing it


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def encode(message: Mapping[str, Any]) -> bytes:
    """One response line."""
    return (
        json.dumps(message, ensure_ascii=False, separators=(",", ":"), default=str) + "\n"
    ).encode("utf-8")


def ok_response(rid: int | None, result: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": rid, "ok": True, "result": dict(result)}


def error_response(rid: int | None, reason: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"reason": reason, "message": message}}


def progress_event(rid: int, phase: str, detail: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "event": "progress",
        "phase": phase,
        "detail": {k: _json_safe(v) for k, v in detail.items()},
    }
