"""A client on one "machine" of the travel tests: run inside that machine's namespaces (for
machine B: ``nsenter`` into its network and mount namespaces), it reaches that machine's Jupyter
server and kernels on that machine's loopback, as a browser or a script on the machine would.

Usage: ``python client.py URL TOKEN RUNTIME_DIR``; then one JSON request per line on stdin, one
JSON answer per line on stdout:

- ``{"op": "request", "method": "GET", "path": "/api/status", "body": null}`` -> ``{"code":
  200, "body": {...}}``
- ``{"op": "wait_ready", "timeout": 120}`` -> ``{"ok": true}`` once the server answers
- ``{"op": "evaluate", "kernel_id": ID, "expressions": {"v": "repr(x)"}}`` -> ``{"values":
  {"v": "..."}}`` (text/plain of each), through the kernel's own connection file
- ``{"op": "execute", "kernel_id": ID, "code": "...", "timeout": 120}`` -> ``{"content": {...}}``

A failure answers ``{"error": "..."}``; the client goes on.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helper"))
from helperkit import Kernel  # noqa: E402


class MachineClient:
    def __init__(self, url: str, token: str, runtime: str) -> None:
        self.url, self.token, self.runtime = url, token, Path(runtime)
        self.kernels: dict[str, Kernel] = {}

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 600.0) -> dict:
        data = json.dumps(body).encode() if body is not None else (
            b"" if method == "POST" else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Content-Type": "application/json", "Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                return {"code": resp.status, "body": json.loads(raw) if raw else {}}
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return {"code": exc.code, "body": json.loads(raw)}
            except ValueError:
                return {"code": exc.code, "body": {"raw": raw.decode(errors="replace")}}

    def wait_ready(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout  # hang guard only
        while True:
            try:
                if self.request("GET", "/api/status", timeout=10)["code"] == 200:
                    return {"ok": True}
            except OSError:
                pass
            if time.monotonic() > deadline:
                return {"error": f"the server did not answer within {timeout} s"}
            time.sleep(0.2)

    def kernel(self, kernel_id: str) -> Kernel:
        if kernel_id not in self.kernels:
            from jupyter_client import BlockingKernelClient

            conn = str(self.runtime / f"kernel-{kernel_id}.json")
            kc = BlockingKernelClient(connection_file=conn)
            kc.load_connection_file()
            kc.start_channels()
            kernel = Kernel(pid=0, connection_file=conn, log_path="", kc=kc)
            kernel.wait_answering(timeout=120)
            self.kernels[kernel_id] = kernel
        return self.kernels[kernel_id]

    def evaluate(self, kernel_id: str, expressions: dict[str, str]) -> dict:
        return {"values": self.kernel(kernel_id).evaluate(**expressions)}

    def execute(self, kernel_id: str, code: str, timeout: float = 120.0) -> dict:
        return {"content": self.kernel(kernel_id).execute(code, timeout=timeout)}

    def forget(self, kernel_id: str) -> dict:
        kernel = self.kernels.pop(kernel_id, None)
        if kernel is not None:
            kernel.close()
        return {"ok": True}


def main() -> None:
    client = MachineClient(*sys.argv[1:4])
    ops = {"request": client.request, "wait_ready": client.wait_ready,
           "evaluate": client.evaluate, "execute": client.execute, "forget": client.forget}
    for line in sys.stdin:
        call = json.loads(line)
        op = call.pop("op")
        try:
            answer = ops[op](**call)
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer, default=repr) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
