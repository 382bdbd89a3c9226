"""A lazy restore in place lets the replaced kernel exit beside it (checkpoint.KillReplaced):
its listeners and the connections they accepted are shut down first, through descriptors taken
from the live process (unix_peers.shut_accepted), and nothing else it holds is touched."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import pytest

from infinijup_helper.unix_peers import shut_accepted

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pidfd_getfd of another process "
                                "needs root (the helper's view)")

# A stand-in for a kernel: a unix and a TCP listener, each with one accepted connection, and a
# socket pair of its own; "pair" on stdin checks that the pair still carries bytes.
CHILD = textwrap.dedent("""
    import socket, sys
    path = sys.argv[1]
    unix = socket.socket(socket.AF_UNIX); unix.bind(path); unix.listen()
    tcp = socket.socket(); tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.1", 0)); tcp.listen()
    a, b = socket.socketpair()
    print(tcp.getsockname()[1], flush=True)
    accepted = [unix.accept()[0], tcp.accept()[0]]
    print("accepted", flush=True)
    for line in sys.stdin:
        a.sendall(b"x")
        print("pair ok" if b.recv(1) == b"x" else "pair broken", flush=True)
""")


@pytest.fixture
def kernel_like() -> Iterator[tuple[subprocess.Popen, str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k-1")
        child = subprocess.Popen([sys.executable, "-c", CHILD, path], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            port = int(child.stdout.readline())
            yield child, path, port
        finally:
            child.kill()
            child.wait()


def test_listeners_and_their_connections_are_shut_and_nothing_else(kernel_like) -> None:
    child, path, port = kernel_like
    unix = socket.socket(socket.AF_UNIX)
    unix.connect(path)
    tcp = socket.create_connection(("127.0.0.1", port))
    assert child.stdout.readline().strip() == "accepted"
    pidfd = os.pidfd_open(child.pid)
    try:
        assert shut_accepted({child.pid: pidfd}) == 2  # the two listeners
    finally:
        os.close(pidfd)

    for sock in (unix, tcp):  # the server's side sees its connection end, now
        sock.settimeout(30)
        assert sock.recv(1) == b""
    with pytest.raises(ConnectionRefusedError):  # a reconnect never reaches the old kernel
        socket.socket(socket.AF_UNIX).connect(path)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=30)

    # its address can be taken at once by the restored kernel, while the old one lives on
    again = socket.socket()
    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    again.bind(("127.0.0.1", port))
    again.listen()
    again.close()
    assert child.poll() is None

    child.stdin.write("pair\n")  # a socket that is not a listener's connection works on
    child.stdin.flush()
    assert child.stdout.readline().strip() == "pair ok"


def test_a_process_with_no_listener_is_left_alone(kernel_like) -> None:
    child, path, _port = kernel_like
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import socket, sys
        c = socket.socket(socket.AF_UNIX); c.connect(sys.argv[1])
        print("connected", flush=True); sys.stdin.readline()
        c.sendall(b"y"); print("sent", flush=True)
    """), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "connected"
        pidfd = os.pidfd_open(other.pid)
        try:
            assert shut_accepted({other.pid: pidfd}) == 0  # a client's socket: not shut
        finally:
            os.close(pidfd)
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "sent"
    finally:
        other.kill()
        other.wait()
