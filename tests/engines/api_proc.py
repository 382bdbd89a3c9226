"""The sidecar's API process: HTTP in front, the engine process behind ZMQ IPC (like
``vllm serve``: an API server and an EngineCore process it starts).

    python api_proc.py PORT MODEL

Routes: ``POST /generate {"id", "prompt", "max_new"}`` -> ``{"id", "tokens"}``; ``GET /stats``
(the engine's, with its pid and when it loaded its weights); ``POST /pause``, ``POST /resume``
(the engine parks between two steps, keeping its requests, as vLLM's ``/pause?mode=keep``).
The IPC sockets live in a fresh directory under /tmp, as vLLM's do.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq  # noqa: E402

from engines.stepengine import serve_http  # noqa: E402


def main() -> None:
    port, kind = int(sys.argv[1]), sys.argv[2]
    ipc_dir = tempfile.mkdtemp(prefix="engine-ipc-")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind(f"ipc://{ipc_dir}/requests")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{ipc_dir}/results")

    def die_with_parent() -> None:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    engine = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__),
                                                            "engine_proc.py"), ipc_dir, kind],
                              preexec_fn=die_with_parent)
    ready = pull.recv_json()
    print(f"engine {engine.pid} ready: {ready}", flush=True)
    waiting: dict = {}
    send_lock = threading.Lock()
    asks = itertools.count()

    def receive() -> None:
        while True:
            msg = pull.recv_json()
            key = msg.get("id") if msg["op"] == "done" else f"ask-{msg.get('ask')}"
            fut = waiting.pop(key, None)
            if fut is not None:
                fut.set_result(msg)

    threading.Thread(target=receive, daemon=True).start()

    def ask(msg: dict, key: str) -> dict:
        fut: Future = Future()
        waiting[key] = fut
        with send_lock:
            push.send_json(msg)
        return fut.result()

    def handle(path: str, body: dict | None) -> dict:
        route = path.split("?")[0]
        if route == "/generate":
            done = ask({"op": "generate", **body}, body["id"])
            return {"id": done["id"], "tokens": done["tokens"]}
        if route in ("/stats", "/pause", "/resume"):
            n = next(asks)
            answer = ask({"op": route[1:], "ask": n}, f"ask-{n}")
            answer.pop("ask", None)
            return {**answer, "api_pid": os.getpid(), "engine_pid": engine.pid}
        raise KeyError(route)

    serve_http(handle, port)
    print(f"listening {port}", flush=True)
    engine.wait()
    print(f"engine exited {engine.returncode}", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
