"""Serving engines in notebooks (issue 17), through the real server, helper and CRIU, with the
test engine of tests/engines (a request queue and a step loop, like vLLM's V1):

- in the kernel: the engine's loop runs in a thread, HTTP is served from the kernel, and the
  engine is registered with ``register_engine``;
- as a sidecar: an API process (HTTP) and the engine process it starts, talking over ZMQ IPC
  sockets under /tmp, parked through ``%sidecar start ... --pause URL --resume URL``.

A stream of generation requests runs while a snapshot is taken: every request completes exactly
once with the tokens of an uninterrupted run, and one request (``max_new`` 0: it runs until the
engine resumes) is surely in flight across the snapshot. Restoring that snapshot brings the
engine back with the requests it held, answering on the same port with the same tokens, without
loading its weights again (the engine process and its load time are those of the snapshot).

The model is ``hash`` (pure Python) everywhere and ``llama`` (a Llama-shaped model with random
weights, bf16, on the GPU) where there is an NVIDIA GPU.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from kernelkit import needs_helper

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from engines.stepengine import call, wait_answering  # noqa: E402

HAS_GPU = os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is not None
MODELS = [pytest.param("hash"),
          pytest.param("llama", marks=pytest.mark.skipif(
              not HAS_GPU, reason="no NVIDIA GPU on this machine (runs on the GPU machine)"))]
PROMPTS = [[1, 15043, 29892, 590], [1, 450, 4996], [1, 3492, 526, 263, 8444, 20255],
           [1, 1724], [1, 306, 763, 17251, 1363, 278]]
MAX_NEW = 24
CLIENTS = 4

pytestmark = [needs_helper, pytest.mark.timeout(900)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Traffic:
    """Client threads, each with one request outstanding at a time, each request a new id,
    until told to finish (then two more each)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.answers: dict[str, list[int]] = {}
        self.sent: dict[str, list[int]] = {}
        self.errors: list[str] = []
        self.finish = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(c,), daemon=True)
                        for c in range(CLIENTS)]

    def _client(self, c: int) -> None:
        i, extra = 0, 2
        while extra > 0:
            if self.finish.is_set():
                extra -= 1
            rid, prompt = f"c{c}-{i}", PROMPTS[(c + i) % len(PROMPTS)]
            self.sent[rid] = prompt
            try:
                self.answers[rid] = call(self.port, "/generate",
                                         {"id": rid, "prompt": prompt, "max_new": MAX_NEW})["tokens"]
            except Exception as exc:
                self.errors.append(f"{rid}: {type(exc).__name__}: {exc}")
            i += 1

    def start(self) -> None:
        for t in self.threads:
            t.start()

    async def stop(self) -> None:
        self.finish.set()
        for t in self.threads:
            await asyncio.to_thread(t.join, 600)
            assert not t.is_alive(), "a client is stuck"


async def until(predicate, what: str, deadline_s: float = 300) -> None:  # noqa: ANN001
    deadline = time.monotonic() + deadline_s
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


def start_sentinel(port: int, answers: dict) -> threading.Thread:
    """A request that runs until the engine resumes from a pause (then 8 tokens more)."""
    def run() -> None:
        answers["sentinel"] = call(port, "/generate",
                                   {"id": "sentinel", "prompt": PROMPTS[0], "max_new": 0})
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


async def check_stream_across_a_snapshot(nb, port: int, reference) -> dict:  # noqa: ANN001
    """Traffic while the kernel is snapshotted; every request once, with the right tokens."""
    answers: dict = {}
    before = set(call(port, "/stats")["completed"])  # the reference runs, if any
    sentinel = start_sentinel(port, answers)
    await until(lambda: call(port, "/stats")["running"] >= 1, "the sentinel request runs")
    traffic = Traffic(port)
    traffic.start()
    await until(lambda: len(traffic.answers) >= CLIENTS, "the clients get answers")
    snap = await nb.snapshot(message="engine mid-traffic")
    await traffic.stop()
    await asyncio.to_thread(sentinel.join, 600)
    assert not traffic.errors, traffic.errors[:5]
    assert traffic.answers.keys() == traffic.sent.keys()
    for rid, tokens in traffic.answers.items():
        assert tokens == reference(tuple(traffic.sent[rid]), MAX_NEW), rid
    sentinel_tokens = answers["sentinel"]["tokens"]
    assert sentinel_tokens == reference(tuple(PROMPTS[0]), len(sentinel_tokens))
    stats = call(port, "/stats")
    # parked with the sentinel running, at least once (the snapshot's quiesce)
    assert any(p["running"] >= 1 for p in stats["pauses"]), stats["pauses"]
    assert not stats["paused"], "the engine was not resumed after the snapshot"
    completed = stats["completed"]
    expected = set(traffic.answers) | {"sentinel"} | before
    assert set(completed) == expected, set(completed) ^ expected
    assert set(completed.values()) == {1}, {k: v for k, v in completed.items() if v != 1}
    return {"snap": snap, "stats": stats, "requests": len(traffic.answers)}


IN_KERNEL = """
import sys, threading
sys.path.insert(0, {tests!r})
from engines.models import make
from engines.stepengine import StepEngine, engine_handler, serve_http
from infinijup.kernel_magics import register_engine
model = make({kind!r})
engine = StepEngine(model)
threading.Thread(target=engine.loop, daemon=True, name="engine-loop").start()
http = serve_http(engine_handler(engine, {{"load_s": getattr(model, "load_s", 0.0)}}), {port})
register_engine(engine)
"""


@pytest.mark.parametrize("kind", MODELS)
async def test_an_engine_in_the_kernel_serves_through_a_snapshot_and_a_restore(notebook, kind):
    nb = notebook
    port = free_port()
    await nb.execute(IN_KERNEL.format(tests=str(TESTS), kind=kind, port=port), timeout=600)
    refs = {}
    for prompt in PROMPTS:
        refs[tuple(prompt)] = await nb.value(f"engine.generate({prompt!r}, 64)")

    def reference(prompt: tuple, n: int) -> list[int]:  # the kernel's uninterrupted run
        assert n <= 64, n
        return refs[prompt][:n]

    seen = await check_stream_across_a_snapshot(nb, port, reference)
    meta = (await nb.history())["commits"][0]["metadata"]
    assert seen["snap"]["commit"] == (await nb.history())["commits"][0]["id"]
    assert meta["engines"] == ["StepEngine"], meta
    print(f"[{kind}] in-kernel engine: {seen['requests']} requests across the snapshot, "
          f"pauses {seen['stats']['pauses']}; metadata keys {sorted(meta)}")

    # the restore: the engine resumes with what it held at the snapshot (the sentinel among
    # it, finished once in this timeline), and answers with the same tokens
    t0 = time.perf_counter()
    await nb.restore(seen["snap"]["commit"])
    answer = await asyncio.to_thread(call, port, "/generate",
                                     {"id": "after-restore", "prompt": PROMPTS[2],
                                      "max_new": MAX_NEW})
    first_answer_s = time.perf_counter() - t0
    assert answer["tokens"] == reference(tuple(PROMPTS[2]), MAX_NEW)
    stats = call(port, "/stats")
    assert not stats["paused"]
    assert set(stats["completed"].values()) == {1}, stats["completed"]
    assert stats["completed"].get("after-restore") == 1
    await until(lambda: call(port, "/stats")["completed"].get("sentinel") == 1,
                "the sentinel held by the snapshot finishes once after the restore")
    print(f"[{kind}] in-kernel engine: restore to the first answer {first_answer_s:.2f} s "
          f"(weights loaded in {stats.get('load_s', 0):.2f} s at first)")


@pytest.mark.parametrize("kind", MODELS)
async def test_a_sidecar_engine_over_zmq_ipc_serves_through_a_snapshot_and_a_restore(notebook,
                                                                                     kind):
    nb = notebook
    port = free_port()
    api = TESTS / "engines" / "api_proc.py"
    url = f"http://127.0.0.1:{port}"
    out = await nb.execute(f"%sidecar start engine --pause {url}/pause --resume {url}/resume -- "
                           f"{shlex.quote(sys.executable)} -u {shlex.quote(str(api))} {port} {kind}")
    assert "Sidecar 'engine' started" in out["stdout"], out
    first = await asyncio.to_thread(wait_answering, port, 600)
    refs = {}
    for i, prompt in enumerate(PROMPTS):  # alone, one at a time: uninterrupted runs
        refs[tuple(prompt)] = (await asyncio.to_thread(
            call, port, "/generate", {"id": f"ref-{i}", "prompt": prompt, "max_new": 64}))["tokens"]

    def reference(prompt: tuple, n: int) -> list[int]:
        assert n <= 64, n
        return refs[prompt][:n]

    seen = await check_stream_across_a_snapshot(nb, port, reference)
    meta = (await nb.history())["commits"][0]["metadata"]
    assert [s["name"] for s in meta["sidecars"]] == ["engine"], meta
    assert meta["engines"] == ["sidecar:engine"], meta
    print(f"[{kind}] sidecar engine: {seen['requests']} requests across the snapshot, "
          f"pauses {seen['stats']['pauses']}")

    t0 = time.perf_counter()
    await nb.restore(seen["snap"]["commit"])
    answer = await asyncio.to_thread(call, port, "/generate",
                                     {"id": "after-restore", "prompt": PROMPTS[3],
                                      "max_new": MAX_NEW})
    first_answer_s = time.perf_counter() - t0
    assert answer["tokens"] == reference(tuple(PROMPTS[3]), MAX_NEW)
    stats = call(port, "/stats")
    # the same engine process, with the weights it loaded before the snapshot: not reloaded
    assert (stats["engine_pid"], stats["loaded_at"]) == (first["engine_pid"], first["loaded_at"])
    assert set(stats["completed"].values()) == {1}, stats["completed"]
    await until(lambda: call(port, "/stats")["completed"].get("sentinel") == 1,
                "the sentinel held by the snapshot finishes once after the restore")
    print(f"[{kind}] sidecar engine: restore to the first answer {first_answer_s:.2f} s; "
          f"its weights were loaded once, in {first['load_s']:.2f} s "
          f"({first.get('params', 0) / 1e9:.2f} B parameters)")
    out = await nb.execute("%sidecar stop engine")
    assert "stopped" in out["stdout"], out


# vLLM's AsyncLLM as engines_vllm.py uses it: the two coroutines, here over the test engine,
# in a package named like vLLM's so that the import hook armed at kernel start finds it.
VLLM_STAND_IN = '''
import asyncio

class AsyncLLM:
    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None,
                               clear_cache=True):
        self.calls.append(("pause", mode, clear_cache))
        await asyncio.get_running_loop().run_in_executor(None, self.engine.pause)

    async def resume_generation(self):
        self.calls.append(("resume",))
        self.engine.resume()
'''

IN_KERNEL_VLLM = """
import asyncio, sys, threading
sys.path.insert(0, {tests!r})
sys.path.insert(0, {stand_in!r})
from engines.models import make
from engines.stepengine import StepEngine, engine_handler, serve_http
engine = StepEngine(make("hash"))
threading.Thread(target=engine.loop, daemon=True, name="engine-loop").start()
http = serve_http(engine_handler(engine), {port})
from vllm.v1.engine.async_llm import AsyncLLM
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True, name="serving-loop").start()
async def make_llm():
    return AsyncLLM(engine)
llm = asyncio.run_coroutine_threadsafe(make_llm(), loop).result()
"""


async def test_a_vllm_async_engine_on_its_own_loop_is_paused_through_its_api(notebook, tmp_path):
    nb = notebook
    package = tmp_path / "stand-in" / "vllm" / "v1" / "engine"
    package.mkdir(parents=True)
    for d in (package, package.parent, package.parent.parent):
        (d / "__init__.py").write_text("")
    (package / "async_llm.py").write_text(VLLM_STAND_IN)
    port = free_port()
    await nb.execute(IN_KERNEL_VLLM.format(tests=str(TESTS), stand_in=str(tmp_path / "stand-in"),
                                           port=port))
    names = await nb.value("__import__('infinijup.kernel_magics.engines', "
                           "fromlist=['_']).registered()")
    assert len(names) == 1 and names[0].startswith("vllm:AsyncLLM@"), names
    refs = {tuple(p): await nb.value(f"engine.generate({p!r}, 64)") for p in PROMPTS}
    seen = await check_stream_across_a_snapshot(nb, port, lambda p, n: refs[p][:n])
    assert await nb.value("llm.calls") == [("pause", "keep", False), ("resume",)]
    meta = (await nb.history())["commits"][0]["metadata"]
    assert meta["engines"] == names, meta
    await nb.restore(seen["snap"]["commit"])
    await until(lambda: call(port, "/stats")["completed"].get("sentinel") == 1,
                "the sentinel held by the snapshot finishes once after the restore")
    # restored: paused in the snapshot, resumed through the API once the kernel was back
    assert await nb.value("llm.calls") == [("pause", "keep", False), ("resume",)]
    assert set(call(port, "/stats")["completed"].values()) == {1}
