"""The request parser alone: only protocol errors come out of it, whatever goes in."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinijup_helper import protocol as p

PROTOCOL_REASONS = {"bad_request", "protocol_version", "unknown_op", "request_too_large"}


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_valid_dump_request_parses_with_defaults() -> None:
    req = p.parse_request(
        _line({"v": 1, "id": 7, "op": "dump", "args": {"pid": 42, "images_dir": "/w/i"}})
    )
    assert req == p.Request(7, "dump", p.DumpArgs(pid=42, images_dir="/w/i", leave_running=True))


def test_restore_with_null_replace_pid() -> None:
    req = p.parse_request(
        _line({"v": 1, "id": 1, "op": "restore", "args": {"images_dir": "/x", "replace_pid": None}})
    )
    assert req.args == p.RestoreArgs(images_dir="/x", replace_pid=None)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"{not json", "bad_request"),
        (b"\xff\xfe", "bad_request"),
        (b"[1, 2]", "bad_request"),
        (b'{"v": 1, "id": 1, "op": "hello", "args": {}, "x": NaN}', "bad_request"),
        (_line({"v": 2, "id": 1, "op": "hello", "args": {}}), "protocol_version"),
        (_line({"id": 1, "op": "hello", "args": {}}), "protocol_version"),
        (_line({"v": True, "id": 1, "op": "hello", "args": {}}), "protocol_version"),
        (_line({"v": 1, "id": "1", "op": "hello", "args": {}}), "bad_request"),
        (_line({"v": 1, "id": 1, "op": "reboot", "args": {}}), "unknown_op"),
        (_line({"v": 1, "id": 1, "op": "hello", "args": []}), "bad_request"),
        (_line({"v": 1, "id": 1, "op": "hello", "args": {"criu_opts": "--foo"}}), "bad_request"),
        (
            _line({"v": 1, "id": 1, "op": "dump", "args": {"pid": True, "images_dir": "/x"}}),
            "bad_request",
        ),
        (
            _line({"v": 1, "id": 1, "op": "dump", "args": {"pid": 1.0, "images_dir": "/x"}}),
            "bad_request",
        ),
        (
            _line({"v": 1, "id": 1, "op": "dump", "args": {"pid": -1, "images_dir": "/x"}}),
            "bad_request",
        ),
        (
            _line({"v": 1, "id": 1, "op": "dump", "args": {"pid": 5, "images_dir": "/x\u0000y"}}),
            "bad_request",
        ),
        (_line({"v": 1, "id": 1, "op": "dump", "args": {"pid": 5}}), "bad_request"),
        (
            _line(
                {
                    "v": 1,
                    "id": 1,
                    "op": "spawn",
                    "args": {"argv": [], "env": {}, "cwd": "/", "log_path": "/l"},
                }
            ),
            "bad_request",
        ),
        (
            _line(
                {
                    "v": 1,
                    "id": 1,
                    "op": "spawn",
                    "args": {"argv": ["a"], "env": {"A=B": "c"}, "cwd": "/", "log_path": "/l"},
                }
            ),
            "bad_request",
        ),
        (
            _line(
                {
                    "v": 1,
                    "id": 1,
                    "op": "spawn",
                    "args": {"argv": ["a"], "env": {"A": 1}, "cwd": "/", "log_path": "/l"},
                }
            ),
            "bad_request",
        ),
        (b'{"v": 1, "id": 1, "op": "release", "args": {"path": "\\ud800"}}', "bad_request"),
        (b"[" * 100_000 + b"]" * 100_000, "bad_request"),
        (b'{"v": 1, "id": ' + b"9" * 5000 + b"}", "bad_request"),
        (b" " * (p.MAX_LINE_BYTES + 1), "request_too_large"),
    ],
)
def test_bad_requests_get_protocol_errors(line: bytes, reason: str) -> None:
    with pytest.raises(p.RequestError) as info:
        p.parse_request(line)
    assert info.value.reason == reason


def test_error_keeps_the_request_id_when_usable() -> None:
    with pytest.raises(p.RequestError) as info:
        p.parse_request(_line({"v": 1, "id": 99, "op": "nope", "args": {}}))
    assert info.value.request_id == 99


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
arg_names = st.sampled_from(
    [
        "pid",
        "images_dir",
        "leave_running",
        "replace_pid",
        "argv",
        "env",
        "cwd",
        "log_path",
        "path",
        "x",
    ]
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([1, 1, 1, 2, 0, "1", None, True]),
        "id": st.one_of(st.integers(-5, 2**60), st.text(max_size=3), st.none()),
        "op": st.one_of(st.sampled_from(sorted(p.OPS)), st.text(max_size=10)),
        "args": st.one_of(st.dictionaries(arg_names, json_values, max_size=5), json_values),
    },
)


@settings(
    max_examples=1000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(requests)
def test_fuzz_structured_requests(message: dict) -> None:
    try:
        req = p.parse_request(json.dumps(message).encode())
    except p.RequestError as exc:
        assert exc.reason in PROTOCOL_REASONS
    else:
        assert req.op in p.OPS


@settings(max_examples=1000, deadline=None, database=None)
@given(st.binary(max_size=300) | st.text(alphabet=string.printable, max_size=300).map(str.encode))
def test_fuzz_raw_bytes(line: bytes) -> None:
    try:
        p.parse_request(line)
    except p.RequestError as exc:
        assert exc.reason in PROTOCOL_REASONS


# Well-typed-looking requests per op, with hostile values: whatever parses is bounded and
# typed exactly as the ops expect (so nothing odd reaches the code that runs as root).
hostile_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["/", "..", "/etc/shadow", "a\x00b", "\ud800", "x" * 5000, "A=B", ""]),
)
hostile_int = st.one_of(
    st.integers(-(2**64), 2**64), st.sampled_from([0, 1, p.MAX_PID, p.MAX_PID + 1, 2**53])
)
hostile_value = st.one_of(
    hostile_text, hostile_int, st.booleans(), st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(hostile_text, max_size=3), st.dictionaries(hostile_text, hostile_text, max_size=3),
)
op_requests = st.sampled_from(sorted(p.OPS)).flatmap(
    lambda op: st.fixed_dictionaries({
        "v": st.just(1),
        "id": st.integers(0, p.MAX_ID),
        "op": st.just(op),
        "args": st.dictionaries(st.sampled_from(sorted(p.ARG_SPECS[op][1]) or ["x"]),
                                hostile_value, max_size=4),
    })
)


def _bounded_text(value: object, limit: int) -> None:
    assert isinstance(value, str) and "\x00" not in value and len(value) <= limit
    value.encode("utf-8")  # no lone surrogates


@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(op_requests)
def test_fuzz_parsed_arguments_are_typed_and_bounded(message: dict) -> None:
    try:
        req = p.parse_request(json.dumps(message).encode())
    except p.RequestError as exc:
        assert exc.reason == "bad_request", exc
        assert exc.request_id == message["id"]
        return
    args = req.args
    assert type(args) is p.ARG_SPECS[req.op][0]
    for name in ("pid", "replace_pid"):
        value = getattr(args, name, None)
        assert value is None or (type(value) is int and 1 <= value <= p.MAX_PID)
    for name in ("images_dir", "cwd", "log_path", "path"):
        if hasattr(args, name) and not (isinstance(args, p.RestoreArgs) and name == "log_path"
                                        and args.log_path is None):
            _bounded_text(getattr(args, name), p.MAX_PATH_CHARS)
            assert getattr(args, name)
    if isinstance(args, p.SignalArgs):
        assert args.signum in p.SIGNALS
    if isinstance(args, p.DumpArgs):
        assert type(args.leave_running) is bool
    if isinstance(args, p.SpawnArgs):
        assert args.argv and args.argv[0]
        for item in args.argv:
            _bounded_text(item, p.MAX_LINE_BYTES)
        for key, value in args.env.items():
            _bounded_text(key, p.MAX_PATH_CHARS)
            _bounded_text(value, p.MAX_LINE_BYTES)
            assert key and "=" not in key
