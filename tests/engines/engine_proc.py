"""The sidecar's engine process: holds the model (on the GPU for ``llama``) and steps requests
that the API process sends over ZMQ IPC, like vLLM V1's EngineCore.

    python engine_proc.py IPC_DIR MODEL

It connects a PULL socket to ``ipc://IPC_DIR/requests`` and a PUSH socket to
``ipc://IPC_DIR/results`` (the API process binds both). Messages are JSON:
``{"op": "generate", "id", "prompt", "max_new"}`` -> ``{"op": "done", "id", "tokens"}``;
``{"op": "stats", "ask"}`` -> ``{"op": "stats", "ask", ...}``; ``{"op": "pause"|"resume", "ask"}``
-> ``{"op": "ok", "ask"}``. Paused, it takes requests in but does not step.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq  # noqa: E402

from engines.models import make  # noqa: E402
from engines.stepengine import StepEngine  # noqa: E402


def main() -> None:
    ipc_dir, kind = sys.argv[1], sys.argv[2]
    t0 = time.time()
    model = make(kind)
    loaded = {"loaded_at": t0, "load_s": time.time() - t0, "model": kind,
              "params": getattr(model, "params", 0)}
    engine = StepEngine(model)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"ipc://{ipc_dir}/requests")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{ipc_dir}/results")
    paused = False
    pending: dict = {}  # request id -> its future, until it is sent back
    push.send_json({"op": "ready", **loaded})
    while True:
        busy = engine.has_work() and not paused
        while pull.poll(0 if busy else 1000):
            msg = json.loads(pull.recv())
            op = msg.get("op")
            if op == "generate":
                pending[msg["id"]] = engine.submit(msg["id"], msg["prompt"], msg["max_new"])
            elif op == "stats":
                push.send_json({"op": "stats", "ask": msg["ask"], **engine.stats(), **loaded})
            elif op == "pause":  # between two steps: parked already
                paused = True
                engine.pauses.append({"running": len(engine.running),
                                      "waiting": len(engine.waiting)})
                push.send_json({"op": "ok", "ask": msg["ask"]})
            elif op == "resume":
                paused = False
                engine.mark_resumed()
                push.send_json({"op": "ok", "ask": msg["ask"]})
            busy = engine.has_work() and not paused
        if busy:
            engine.step()
        for rid in [r for r, f in pending.items() if f.done()]:
            push.send_json({"op": "done", "id": rid, "tokens": pending.pop(rid).result()})


if __name__ == "__main__":
    main()
