"""A serving engine written for the tests (issue 17), laid out like vLLM's V1: a request queue
and a step loop; each step admits the waiting requests (prefill: their first token) and gives
every running request one more token (decode), greedily. Requests run one sequence at a time
on the model, so a request's tokens do not depend on what else was running: an interrupted run
must give exactly the tokens of an uninterrupted one.

``pause()`` parks the loop at a step boundary, keeping running and waiting requests, and new
requests are still queued; ``resume()`` goes on (the contract of infinijup's engines.py and of
vLLM's ``pause_generation(mode="keep")``). ``completed`` counts each request id finished, so a
test can see that none ran twice.

Used in the kernel (a thread runs :meth:`StepEngine.loop`, :func:`serve_http` answers HTTP) and
in the sidecar's engine process (engine_proc.py drives :meth:`StepEngine.step` itself).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_new: int
    future: Future = field(default_factory=Future)
    state: object = None
    tokens: list[int] = field(default_factory=list)


class StepEngine:
    def __init__(self, model) -> None:  # noqa: ANN001 - prefill(ids) / decode(state, tok)
        self.model = model
        self.cond = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[str, Request] = {}
        self.completed: collections.Counter = collections.Counter()
        self.steps = 0
        self.pauses: list[dict] = []  # what each pause kept: {"running": n, "waiting": n}
        self._pause = False
        self._parked = False
        self._stop = False

    # --- the API ----------------------------------------------------------------------------
    def submit(self, rid: str, prompt: list[int], max_new: int) -> Future:
        req = Request(rid, list(prompt), int(max_new))
        with self.cond:
            self.waiting.append(req)
            self.cond.notify_all()
        return req.future

    def pause(self) -> None:
        """Return once the loop is parked between two steps; requests stay where they are."""
        with self.cond:
            self._pause = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: self._parked or self._stop)
            self.pauses.append({"running": len(self.running), "waiting": len(self.waiting)})

    def resume(self) -> None:
        with self.cond:
            self._pause = False
            self.mark_resumed()
            self.cond.notify_all()

    def mark_resumed(self) -> None:
        """A request with ``max_new`` 0 gets its first token, then is held until the engine
        resumes from a pause, then gets 8 tokens more: a test's way to have a request surely
        in flight (its state, on the GPU for ``llama``, in the engine) across a snapshot."""
        for req in [*self.running.values(), *self.waiting]:
            if req.max_new == 0:
                req.max_new = len(req.tokens) + 8

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()

    def stats(self) -> dict:
        with self.cond:
            return {"pid": os.getpid(), "steps": self.steps, "pauses": list(self.pauses),
                    "completed": dict(self.completed), "running": len(self.running),
                    "waiting": len(self.waiting), "paused": self._pause}

    # --- the loop ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r.max_new for r in self.running.values())

    def loop(self) -> None:
        """Step while there is work and no pause; park (between steps) otherwise."""
        while True:
            with self.cond:
                while not self._stop and (self._pause or not self.has_work()):
                    self._parked = True
                    self.cond.notify_all()
                    self.cond.wait()
                self._parked = False
                if self._stop:
                    return
            self.step()

    def step(self) -> None:
        with self.cond:
            admitted = list(self.waiting)
            self.waiting.clear()
            decoding = list(self.running.values())
        done = []
        for req in decoding:  # decode: one more token each
            if not req.max_new:
                continue  # held until the engine resumes from a pause (mark_resumed)
            req.state, token = self.model.decode(req.state, req.tokens[-1])
            req.tokens.append(token)
            if req.max_new and len(req.tokens) >= req.max_new:
                done.append(req)
        for req in admitted:  # prefill: the first token
            req.state, token = self.model.prefill(req.prompt)
            req.tokens.append(token)
            if req.max_new and len(req.tokens) >= req.max_new:
                done.append(req)
        with self.cond:
            for req in admitted:
                self.running[req.rid] = req
            for req in done:
                del self.running[req.rid]
                self.completed[req.rid] += 1
            self.steps += 1
        for req in done:
            req.state = None
            req.future.set_result(list(req.tokens))

    def generate(self, prompt: list[int], max_new: int) -> list[int]:
        """The uninterrupted reference: one request alone, the same prefill and decode."""
        state, token = self.model.prefill(list(prompt))
        tokens = [token]
        while len(tokens) < max_new:
            state, token = self.model.decode(state, token)
            tokens.append(token)
        return tokens


# --- HTTP ------------------------------------------------------------------------------------
def serve_http(handle, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:  # noqa: ANN001
    """Serve ``handle(path, body) -> dict`` on ``port`` from a thread (POST and GET, JSON)."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: dict | None) -> None:
            try:
                out = json.dumps(handle(self.path, body)).encode()
                code = 200
            except Exception as exc:  # the client sees what went wrong
                out, code = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode(), 500
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(None)

        def do_POST(self) -> None:  # noqa: N802
            size = int(self.headers.get("Content-Length") or 0)
            self._answer(json.loads(self.rfile.read(size) or b"{}"))

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
    return server


def engine_handler(engine: StepEngine, extra: dict | None = None):  # noqa: ANN201
    """The routes of an engine served in-process: /generate, /stats, /pause, /resume."""

    def handle(path: str, body: dict | None) -> dict:
        route = path.split("?")[0]
        if route == "/generate":
            tokens = engine.submit(body["id"], body["prompt"], body["max_new"]).result()
            return {"id": body["id"], "tokens": tokens}
        if route == "/stats":
            return {**engine.stats(), **(extra or {})}
        if route == "/pause":
            engine.pause()
            return {"status": "paused"}
        if route == "/resume":
            engine.resume()
            return {"status": "resumed"}
        raise KeyError(route)

    return handle


# --- a client ----------------------------------------------------------------------------------
def call(port: int, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as answer:
        return json.loads(answer.read())


def wait_answering(port: int, deadline_s: float = 300) -> dict:
    """/stats once the server answers (a hang guard only)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return call(port, "/stats", timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
