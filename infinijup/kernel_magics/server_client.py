"""The kernel's way to the Jupyter server's Infinijup routes (for the magics).

The server exports its URL into the environment its kernels inherit (a restored kernel is told
its new server's, ``retarget.adopt``). Requests are signed with the kernel's own message key
(``kernel_auth.py``): the server's token never enters a kernel. Each call is one short HTTP
request with ``Connection: close``: no connection stays open across a snapshot.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .. import config, kernel_auth


class ServerError(RuntimeError):
    def __init__(self, status: int, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def kernel_id() -> str:
    kid = os.environ.get(config.KERNEL_ID_ENV)
    if not kid:
        raise ServerError(0, "this kernel was not started by Infinijup's provisioner: "
                             "choose the kernel 'Python 3 (Infinijup)'", "not_managed")
    return kid


def _signing_key() -> bytes:
    """The key this kernel signs its Jupyter messages with (the server knows it)."""
    try:
        from IPython import get_ipython

        key = get_ipython().kernel.session.key
    except AttributeError:
        key = b""
    if not key:
        raise ServerError(0, "this code is not running in a Jupyter kernel with a message key",
                          "not_managed")
    return key


def request(method: str, path: str, body: dict | None = None, timeout: float = 60) -> dict:
    base = os.environ.get(config.SERVER_URL_ENV)
    if not base:
        raise ServerError(0, "no Jupyter server with Infinijup is known to this kernel "
                             f"({config.SERVER_URL_ENV} is unset)", "no_server")
    url = base.rstrip("/") + path
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Connection", "close")
    parts = urllib.parse.urlsplit(url)
    uri = parts.path + (f"?{parts.query}" if parts.query else "")
    req.add_header("Authorization", kernel_auth.sign(_signing_key(), kernel_id(), method, uri,
                                                     data or b"", time.time()))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        try:
            payload = json.loads(err.read() or b"{}")
        except ValueError:
            payload = {}
        raise ServerError(err.code, payload.get("message", str(err)), payload.get("reason", "error")) from None
    except urllib.error.URLError as err:
        raise ServerError(0, f"cannot reach the Jupyter server at {base}: {err.reason}", "no_server") from None
    return json.loads(raw or b"{}")


def wait_result(request_id: str, timeout: float, dumped: bool = False) -> dict:
    """Wait for the server's result file of an operation this kernel asked for.

    Polling a file keeps no connection open while the kernel is dumped; a kernel restored from
    that snapshot wakes up here too and reads the same result. ``dumped``: a snapshot's early
    answer (``<id>.dumped.json``, written once the kernel is dumped, before the store has the
    commit) will do too; the final one is preferred when both are there.
    """
    directory = Path(config.results_dir())
    paths = [directory / f"{request_id}.json"]
    if dumped:
        paths.append(directory / f"{request_id}.dumped.json")
    deadline = time.monotonic() + timeout
    delay = 0.01
    while time.monotonic() < deadline:
        for path in paths:
            try:
                return json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                pass
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)
    raise ServerError(0, f"no result for request {request_id} after {timeout:.0f} s", "timeout")
