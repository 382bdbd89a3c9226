"""An operation as a sequence of named steps, each with its own undo.

    async with Steps(log) as step:
        info = await step("quiesce", quiesce(), undo=resume_hooks)
        ...

A step that succeeds may leave an undo (a callable, sync or async). If a later step fails, the
undos of the steps done so far run newest first, then the failure goes on up; an undo that
fails is logged and never hides the cause.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

Undo = Callable[[], Any]


class Steps:
    def __init__(self, log: logging.Logger | logging.LoggerAdapter | None = None) -> None:
        self.log = log or logging.getLogger(__name__)
        self.done: list[str] = []
        self._undo: list[tuple[str, Undo]] = []

    async def __call__(self, name: str, action: Awaitable | None = None, *,
                       undo: Undo | None = None) -> Any:
        result = await action if action is not None else None
        self.done.append(name)
        if undo is not None:
            self._undo.append((name, undo))
        return result

    async def unwind(self) -> None:
        while self._undo:
            name, undo = self._undo.pop()
            try:
                out = undo()
                if inspect.isawaitable(out):
                    await out
            except Exception as exc:  # the cause is what failed first
                self.log.warning("infinijup: undoing step %s failed: %s", name,
                                 getattr(exc, "message", exc))

    async def __aenter__(self) -> Steps:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is not None:
            await self.unwind()
