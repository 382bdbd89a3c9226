"""vLLM engines in the kernel are parked for a snapshot through vLLM's own API (issue 17).

Armed at kernel start (:func:`arm`), this does nothing until the user imports
``vllm.v1.engine.async_llm`` (after_import.py); then every ``AsyncLLM`` made in the kernel is
registered with ``engines.py``:

- pause: ``await llm.pause_generation(mode="keep", clear_cache=False)``: the scheduler stops at
  a step boundary and keeps its requests, running and waiting, with their KV cache; requests
  that arrive meanwhile are queued. On vLLM versions whose ``pause_generation`` has no ``mode``
  (the first ones: ``wait_for_inflight_requests``, ``clear_cache``), in-flight requests are
  waited for instead (``wait_for_inflight_requests=True, clear_cache=False``).
- resume: ``await llm.resume_generation()``.

Both coroutines run on the event loop the engine was made on. A snapshot's quiesce runs on the
kernel's main thread, inside the kernel's own event loop: an ``AsyncLLM`` made there (top-level
``await`` in a cell) cannot be awaited from it, and needs no pause: that loop does not run while
the kernel is quiesced, so the frontend admits nothing, and the engine core process, a child of
the kernel, is frozen in the same instant by CRIU with its queues and sockets, and its GPU state
through the driver's checkpoint. Such engines are reported as frozen with the tree. An engine on
a loop of its own (a thread serving HTTP from the kernel) is paused and resumed through that
loop.

The offline ``LLM`` class needs nothing: its engine steps only inside ``generate()``, which
returns before any snapshot can be taken (a snapshot waits for the running cell).

Written against vLLM's source at commit 00080ee13c7a (``vllm/v1/engine/async_llm.py``:
``pause_generation(*, mode: PauseMode = "abort", wait_for_inflight_requests=None,
clear_cache=True)``, ``resume_generation()``, ``PauseMode`` = "abort" | "wait" | "keep"). vLLM
cannot be installed on the machines this was built on: this module is exercised against the
test engine's stand-in of that API only (tests/kernel/test_engines.py); see docs/engines.md.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import weakref

from . import engines
from .after_import import after_import

MODULE = "vllm.v1.engine.async_llm"
PAUSE_TIMEOUT_S = 300.0
_state: dict = {"armed": False, "hooked": False}


def arm() -> None:
    """Register vLLM's engines once vLLM's AsyncLLM module is imported (call at kernel start)."""
    if _state["armed"]:
        return
    _state["armed"] = True
    after_import(MODULE, hook_module)


def hook_module(module: object) -> None:
    """Wrap ``module.AsyncLLM.__init__`` so that each new engine is registered."""
    cls = getattr(module, "AsyncLLM", None)
    if cls is None or getattr(cls, "_infinijup_hooked", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN001, N807
        init(self, *args, **kwargs)
        try:
            watch(self)
        except Exception:  # never in the way of the user's engine
            pass

    __init__.__wrapped__ = init
    cls.__init__ = __init__
    cls._infinijup_hooked = True
    _state["hooked"] = True


def watch(llm: object, loop: asyncio.AbstractEventLoop | None = None) -> str:
    """Register ``llm`` (an ``AsyncLLM``, or anything with its two coroutines) with the loop
    it runs on: the running loop of the thread that made it, unless given."""
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
    adapter = _Adapter(llm, loop)
    return engines.register_engine(pause=adapter.pause, resume=adapter.resume,
                                   name=f"vllm:{type(llm).__name__}@{id(llm):x}")


class _Adapter:
    def __init__(self, llm: object, loop: asyncio.AbstractEventLoop | None) -> None:
        self.llm = weakref.ref(llm)
        self.loop = loop
        self.how = None  # what the last pause did: "keep", "wait", "frozen with the tree"

    def _loop_elsewhere(self) -> asyncio.AbstractEventLoop | None:
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return None
        try:
            if asyncio.get_running_loop() is loop:
                return None  # the kernel's own loop: it is blocked by this quiesce
        except RuntimeError:
            pass
        if getattr(loop, "_thread_id", None) == threading.get_ident():
            return None
        return loop

    def pause(self) -> None:
        llm, loop = self.llm(), self._loop_elsewhere()
        if llm is None or loop is None:
            self.how = "frozen with the tree"
            return
        kwargs = pause_arguments(llm.pause_generation)
        self.how = kwargs.get("mode", "wait")
        asyncio.run_coroutine_threadsafe(llm.pause_generation(**kwargs), loop) \
            .result(PAUSE_TIMEOUT_S)

    def resume(self) -> None:
        llm, loop = self.llm(), self._loop_elsewhere()
        if llm is None or loop is None or self.how == "frozen with the tree":
            return
        asyncio.run_coroutine_threadsafe(llm.resume_generation(), loop).result(PAUSE_TIMEOUT_S)


def pause_arguments(pause_generation: object) -> dict:
    """The keyword arguments that park without losing anything, for this vLLM version."""
    try:
        params = inspect.signature(pause_generation).parameters
    except (TypeError, ValueError):
        params = {}
    if "mode" in params:
        return {"mode": "keep", "clear_cache": False}
    kwargs: dict = {}
    if "wait_for_inflight_requests" in params:
        kwargs["wait_for_inflight_requests"] = True
    if "clear_cache" in params:
        kwargs["clear_cache"] = False
    return kwargs
