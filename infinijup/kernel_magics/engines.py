"""Serving engines inside the kernel are parked for a snapshot and go on after it (issue 17).

An engine that runs a loop of its own in the kernel (a thread stepping a request queue, an
event loop in a thread serving HTTP) keeps writing GPU memory and its queues while the rest of
the kernel is quiesced. Registered with :func:`register_engine`, it is paused first in a
snapshot's quiesce (before the other hooks synchronize the GPU streams and before Infinijup moves
the GPU memory out) and resumed last, after the snapshot or a restore (once the GPU memory is
back and the other resume hooks have run).

The contract an engine meets (the same for vLLM, SGLang or a user's own loop):

- ``pause()`` returns once the loop is parked at a step boundary: no step in progress, no GPU
  work queued by the engine, requests already admitted kept where they are (not finished early,
  not dropped), and new requests may still be queued but are not scheduled.
- ``resume()`` lets the loop go on from where it was parked; requests kept or queued meanwhile
  run once.

Pass ``pause``/``resume`` callables, or an object that has ``pause()`` and ``resume()``. Engines
resume in the reverse order of their pauses. An engine whose ``pause`` fails is not resumed (it
never paused) and the error is in the snapshot's answer; the snapshot goes on, frozen as a
whole process tree, which is consistent but not parked.

vLLM is handled by ``engines_vllm.py``, armed at kernel start and loaded only once vLLM is
imported.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Engine:
    name: str
    pause: Callable[[], object]
    resume: Callable[[], object]
    owner: weakref.ref | None = None  # the engine object, when it was given as one

    def gone(self) -> bool:
        return self.owner is not None and self.owner() is None


_lock = threading.Lock()
_engines: list[_Engine] = []
_paused: list[_Engine] = []


def register_engine(engine: object = None, *, pause: Callable[[], object] | None = None,
                    resume: Callable[[], object] | None = None, name: str | None = None) -> str:
    """Park ``engine`` for every snapshot of this kernel; return the name it is known by.

    ``register_engine(obj)`` uses ``obj.pause()`` and ``obj.resume()`` and forgets the engine
    once ``obj`` is garbage collected; ``register_engine(pause=f, resume=g, name=...)`` takes
    the callables themselves."""
    if engine is not None:
        pause = pause or getattr(engine, "pause", None)
        resume = resume or getattr(engine, "resume", None)
    if not callable(pause) or not callable(resume):
        raise TypeError("an engine needs pause() and resume() (or pass pause=, resume=)")
    owner = None
    if engine is not None:
        try:
            owner = weakref.ref(engine)
        except TypeError:
            owner = None
        # Bound methods would keep the engine alive: call them through the weak reference.
        if getattr(pause, "__self__", None) is engine and getattr(resume, "__self__", None) is engine:
            pause_name, resume_name = pause.__name__, resume.__name__
            pause = _through(owner, pause_name) if owner else pause
            resume = _through(owner, resume_name) if owner else resume
    label = name or (type(engine).__name__ if engine is not None else
                     getattr(pause, "__qualname__", "engine"))
    with _lock:
        _engines.append(_Engine(label, pause, resume, owner))
    return label


def _through(ref: weakref.ref, method: str) -> Callable[[], object]:
    def call() -> object:
        target = ref()
        return None if target is None else getattr(target, method)()
    return call


def unregister_engine(name: str) -> None:
    with _lock:
        _engines[:] = [e for e in _engines if e.name != name]


def registered() -> list[str]:
    with _lock:
        _engines[:] = [e for e in _engines if not e.gone()]
        return [e.name for e in _engines]


def pause_all() -> dict:
    """The quiesce step: pause every engine; the names parked and the errors."""
    errors, parked = [], []
    with _lock:
        _engines[:] = [e for e in _engines if not e.gone()]
        engines = list(_engines)
    for engine in engines:
        try:
            engine.pause()
        except Exception as exc:
            errors.append(f"engine {engine.name}: pause: {type(exc).__name__}: {exc}")
            continue
        _paused.append(engine)
        parked.append(engine.name)
    return {"parked": parked, "errors": errors}


def resume_all() -> list[str]:
    """The resume step: resume the engines paused, last paused first; the errors."""
    errors = []
    while _paused:
        engine = _paused.pop()
        try:
            engine.resume()
        except Exception as exc:
            errors.append(f"engine {engine.name}: resume: {type(exc).__name__}: {exc}")
    return errors
