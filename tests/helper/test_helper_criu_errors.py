"""Issue 26: a failed CRIU run's error message leads with its cause, not with CRIU's first log line.

CRIU's first error (the RPC answer's ``cr_errmsg``) is, on most machines, a line every run prints
("rlimit: Can't setup RLIMIT_NOFILE for self"); its last ones are each layer giving up
("Restoring FAILED."). The unit tests read sample logs written in CRIU's format (criu/log.c: the
time, the restoring task's pid, ``Error (file:line): prefix: message``); the last test makes a
real restore fail on a port another process took.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from helperkit import MISSING, wait_for

from infinijup_helper import criu
from infinijup_helper.criu import failure_message, log_tail, parse_log

RLIMIT = ("(00.023308) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: "
          "Operation not permitted")

PORT_TAKEN = f"""\
(00.000000) Version: 4.2 (gitid 0)
{RLIMIT}
(00.027663)      1: Opening 0x007f267a083000-0x007f267a086000 0000000000000000 (20000041) vma
(00.027817)      2: Restoring resources
(00.027829)      2: Opening fdinfo-s
(00.027860)      3: inet: \tRestore: family AF_INET    type SOCK_STREAM    proto IPPROTO_TCP      port 8888 state TCP_LISTEN       src_addr 0.0.0.0
(00.027865)      2: inet: \tRestore: family AF_INET    type SOCK_STREAM    proto IPPROTO_TCP      port 45123 state TCP_LISTEN       src_addr 127.0.0.1
(00.027870)      3: Restoring resources
(00.027894)      2: Error (criu/sk-inet.c:1059): inet: Can't bind inet socket (id 24): Address already in use
(00.027907)      2: Error (criu/files.c:1221): Unable to open fd=3 id=0x18
(00.028852)      1: Error (criu/cr-restore.c:1265): 2 exited, status=1
(00.029665) Error (criu/cr-restore.c:2331): Restoring FAILED.
(00.029700)      1: Opening 0x007f267a086000-0x007f267a099000 0x00000000003000 (20000041) vma
"""


def test_a_taken_port_is_named() -> None:
    report = parse_log(PORT_TAKEN)
    assert report.cause is not None
    assert report.cause.startswith("port 45123 is taken by another process (TCP on 127.0.0.1")
    assert "Can't bind inet socket (id 24)" in report.cause  # CRIU's own word, after it
    # then CRIU's error lines, the harmless one left out, then the log's last lines
    lines = report.excerpt.splitlines()
    assert "sk-inet.c:1059" in lines[0] and "Restoring FAILED." in lines[3]
    assert "RLIMIT_NOFILE" not in "\n".join(lines[:4])
    assert lines[-1].endswith("(20000041) vma")


def test_a_port_without_its_restore_line_is_still_said_to_be_taken() -> None:
    text = "\n".join([RLIMIT, "(00.027894)      2: Error (criu/sk-inet.c:1059): inet: Can't bind "
                      "inet socket (id 7): Address already in use"])
    cause = parse_log(text).cause
    assert cause is not None and cause.startswith("a port the snapshot's kernel had is taken")


def test_a_taken_unix_socket_path_is_named() -> None:
    text = "\n".join([
        RLIMIT,
        "(00.036393)      2: Error (criu/sk-unix.c:1651): unix: Can't bind id 0x19 ino 25820 "
        "addr /home/ann/work/kernel: 1.sock: Address already in use",
        "(00.036407)      2: Error (criu/files.c:1221): Unable to open fd=4 id=0x19",
        "(00.037789) Error (criu/cr-restore.c:2331): Restoring FAILED.",
    ])
    cause = parse_log(text).cause
    assert cause is not None
    assert cause.startswith("socket path /home/ann/work/kernel: 1.sock is taken"), cause


def test_a_taken_abstract_unix_socket_name() -> None:
    text = ("(00.036393)      2: Error (criu/sk-unix.c:1651): unix: Can't bind id 0x19 ino 25820 "
            "addr : Address already in use")
    cause = parse_log(text).cause
    assert cause is not None and cause.startswith("an abstract unix socket name"), cause


def test_a_dump_failure_leads_with_the_cause_not_with_giving_up() -> None:
    text = "\n".join([
        RLIMIT,
        "(00.120000) Error (criu/sk-inet.c:200): inet: Connected TCP socket, consider using "
        "--tcp-established option.",
        "(00.120100) Error (criu/cr-dump.c:1698): Dump files (pid: 1234) failed with -1",
        "(00.130000) Error (criu/cr-dump.c:2128): Dumping FAILED.",
    ])
    assert parse_log(text).cause == ("inet: Connected TCP socket, consider using "
                                     "--tcp-established option.")


def test_a_bind_that_fails_otherwise_is_said_as_criu_says_it() -> None:
    text = ("(00.027894)      2: Error (criu/sk-inet.c:1059): inet: Can't bind inet socket (id 24): "
            "Permission denied")
    assert parse_log(text).cause == "inet: Can't bind inet socket (id 24): Permission denied"


def test_only_giving_up_lines_name_the_first_of_them() -> None:
    text = "\n".join([
        RLIMIT,
        "(00.028852)      1: Error (criu/cr-restore.c:1262): 2 killed by signal 9: Killed",
        "(00.029665) Error (criu/cr-restore.c:2331): Restoring FAILED.",
    ])
    assert parse_log(text).cause == "2 killed by signal 9: Killed"


def test_a_log_of_harmless_lines_names_no_cause(tmp_path: Path) -> None:
    (tmp_path / "restore.log").write_text(RLIMIT + "\n(00.030000) Restore finished\n")
    assert parse_log(RLIMIT).cause is None
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        message = failure_message(fd, "restore.log", RLIMIT.split(") ", 1)[1])
        assert message.splitlines()[0] == "CRIU's log names no cause"
        message = failure_message(fd, "restore.log", "Connection refused")
        assert message.splitlines()[0] == "Connection refused"
        assert log_tail(fd, "restore.log").splitlines()[-1].endswith("Restore finished")
    finally:
        os.close(fd)


def test_the_message_leads_with_the_cause_and_keeps_the_tail(tmp_path: Path) -> None:
    (tmp_path / "restore.log").write_text(PORT_TAKEN)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        message = failure_message(fd, "restore.log", RLIMIT.split(") ", 1)[1])
        assert message.startswith("port 45123 is taken by another process"), message
        assert "Restoring FAILED." in message and message.endswith("(20000041) vma")
        assert log_tail(fd, "restore.log").startswith("port 45123 is taken")
        assert failure_message(fd, "absent.log", "error").splitlines() == ["error",
                                                                           "(no CRIU log)"]
    finally:
        os.close(fd)


def test_a_long_log_is_read_from_its_end(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(criu, "LOG_SCAN_BYTES", 4096)
    filler = "".join(f"(00.0{i:05d})      1: Opening vma {i}\n" for i in range(2000))
    (tmp_path / "restore.log").write_text(RLIMIT + "\n" + filler + PORT_TAKEN)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert log_tail(fd, "restore.log").startswith("port 45123 is taken")
    finally:
        os.close(fd)


LISTENER = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen()
print("port", s.getsockname()[1], flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_a_restore_onto_a_taken_port_names_the_port(client, trees) -> None:
    """A real restore whose kernel's listening port another process has taken since the dump:
    the message names the port first (it used to start with the rlimit line)."""
    from infinijup.errors import HelperError

    work = client.work_dir()
    log = f"{work}/listener-{os.getpid()}.log"
    root = trees.add(client.spawn([sys.executable, "-c", LISTENER], {"PATH": "/usr/bin:/bin"},
                                  work, log))
    wait_for(lambda: "port" in Path(log).read_text(), what="the listener to bind")
    port = int(Path(log).read_text().split()[1])
    images = f"{work}/taken-port-{os.getpid()}"
    client.dump(root, images, leave_running=False)
    taker = socket.socket()
    try:
        taker.bind(("127.0.0.1", port))
        taker.listen()
        with pytest.raises(HelperError) as failed:
            client.restore(images)
        assert failed.value.reason == "criu_failed"
        first = str(failed.value).splitlines()[0]
        assert first.startswith(f"CRIU restore failed: port {port} is taken by another process"), \
            str(failed.value)
    finally:
        taker.close()
        client.release(images)
