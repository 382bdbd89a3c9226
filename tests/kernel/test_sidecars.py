"""Sidecars (issue 17), on the CPU, through a real server, helper and CRIU: ``%sidecar``'s
lifecycle, and a sidecar holding a listening TCP socket and a unix socket to the kernel comes
back with the kernel's snapshot, answering on the same port with the state it had then."""

from __future__ import annotations

import asyncio
import shlex
import socket
import sys
import time

import psutil
import pytest
from kernelkit import needs_helper

pytestmark = [needs_helper, pytest.mark.timeout(600)]

# A small server: each TCP connection gets the next count; lines on the unix socket (fd 3,
# passed by the kernel) come back upper-cased.
SERVER = r"""
import os, socket, sys, threading
port = int(sys.argv[1])
unix = socket.socket(fileno=int(sys.argv[2]))
def echo():
    f = unix.makefile("rwb", buffering=0)
    for line in f:
        f.write(line.upper())
threading.Thread(target=echo, daemon=True).start()
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen()
print("listening", port, flush=True)
count = 0
while True:
    conn, _ = srv.accept()
    count += 1
    conn.sendall(f"{count}\n".encode()); conn.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def fetch_count(port: int, deadline_s: float = 120) -> int:
    """The sidecar's next count (retrying while it comes up; a hang guard only)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            line = await asyncio.wait_for(reader.readline(), deadline_s)
            writer.close()
            return int(line)
        except (ConnectionError, OSError, ValueError):
            assert time.monotonic() < deadline, f"nothing answers on port {port}"
            await asyncio.sleep(0.1)


async def wait_for(nb, expr: str, deadline_s: float = 120):
    deadline = time.monotonic() + deadline_s
    while not await nb.value(expr):
        assert time.monotonic() < deadline, f"never true: {expr}"
        await asyncio.sleep(0.1)


async def test_start_list_logs_stop_and_a_shutdown_ends_them(notebook, jp_serverapp):
    nb = notebook
    out = await nb.execute(f"%sidecar start talker -- {shlex.quote(sys.executable)} -u -c "
                           "\"import time; print('hello from the sidecar'); time.sleep(10**6)\"")
    assert "Sidecar 'talker' started" in out["stdout"], out
    listed = (await nb.execute("%sidecar list"))["stdout"]
    assert listed.startswith("talker\tpid ") and "\trunning\t" in listed, listed
    await wait_for(nb, "'hello from the sidecar' in __import__('infinijup.kernel_magics."
                       "sidecars', fromlist=['_']).logs('talker')")
    assert "hello from the sidecar" in (await nb.execute("%sidecar logs talker"))["stdout"]
    # a second start of a running name, an unknown name, a bad name: clear errors
    for bad, says in [("%sidecar start talker -- sleep 1", "is running"),
                      ("%sidecar stop nobody", "no sidecar 'nobody'"),
                      ("%sidecar start ../x -- sleep 1", "bad sidecar name")]:
        r = await nb.collect(nb.send_execute(bad))
        assert r["reply"]["status"] == "error" and says in r["reply"]["evalue"], (bad, r)
    stopped = (await nb.execute("%sidecar stop talker"))["stdout"]
    assert "stopped (exit code -15)" in stopped, stopped
    assert "exited (-15)" in (await nb.execute("%sidecar list"))["stdout"]
    # one left running ends with its kernel
    await nb.execute("%sidecar start sleeper -- sleep 1000000")
    pid = await nb.value("__import__('infinijup.kernel_magics.sidecars', "
                         "fromlist=['_'])._sidecars['sleeper'].pid")
    kernel_root = jp_serverapp.kernel_manager.get_kernel(nb.kernel_id).provisioner.root_pid
    host_pids = {p.pid for p in psutil.Process(kernel_root).children(recursive=True)}
    sleepers = [p for p in host_pids if psutil.Process(p).cmdline()[:1] == ["sleep"]]
    assert len(sleepers) == 1, (pid, host_pids)
    r = await nb.fetch("api", "kernels", nb.kernel_id, method="DELETE")
    assert r.code == 204
    deadline = time.monotonic() + 120
    while psutil.pid_exists(sleepers[0]) and \
            psutil.Process(sleepers[0]).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the sidecar outlived its kernel"
        await asyncio.sleep(0.1)


async def test_a_sidecar_with_its_sockets_comes_back_with_the_kernel(notebook, tmp_path):
    nb = notebook
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    await nb.execute(
        "import socket, sys\n"
        "from infinijup.kernel_magics import sidecars\n"
        "kernel_end, sidecar_end = socket.socketpair()\n"
        f"srv = sidecars.start('counter', [sys.executable, '-u', {str(script)!r}, '{port}', "
        "str(sidecar_end.fileno())], pass_fds=(sidecar_end.fileno(),))\n"
        "sidecar_end.close()\n"
        "unix = kernel_end.makefile('rwb', buffering=0)\n"
        "def ask(text):\n"
        "    unix.write(text.encode() + b'\\n'); return unix.readline().decode().strip()\n")
    assert await fetch_count(port) == 1
    assert await nb.value("ask('before')") == "BEFORE"
    snap = await nb.snapshot(message="sidecar counted 1")
    hist = await nb.history()
    meta = hist["commits"][0]["metadata"]
    assert [(s["name"], s["running"]) for s in meta["sidecars"]] == [("counter", True)], meta
    assert await fetch_count(port) == 2
    assert await fetch_count(port) == 3
    await nb.restore(snap["commit"])
    # the same port, the state of the snapshot (the next count is 2 again), and the unix
    # socket between the kernel and the sidecar works
    assert await fetch_count(port) == 2
    assert await nb.value("ask('after')") == "AFTER"
    assert "listening" in await nb.value("sidecars.logs('counter')")
    out = await nb.execute("%sidecar stop counter")
    assert "stopped" in out["stdout"], out
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=30).close()  # nobody listens
    assert meta["sidecars"][0]["argv"][1:3] == ["-u", str(script)]
