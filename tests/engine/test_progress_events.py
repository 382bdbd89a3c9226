"""Every phase the engine and the helper report reaches the event bus (serverext/events.py):
the operation schema knows a few phases, and an event that does not validate is dropped."""

import asyncio
import logging

from jupyter_events.logger import EventLogger

import infinijup_helper.checkpoint  # noqa: F401 - the helper's stages, as the helper has them
import infinijup_helper.cuda_stage  # noqa: F401
import infinijup_helper.host_files  # noqa: F401
import infinijup_helper.retarget  # noqa: F401
from infinijup.engine.lifecycle import Operation
from infinijup.serverext import SCHEMA
from infinijup.serverext.events import EVENT_SCHEMA_ID, PHASE_PERCENT, Events
from infinijup_helper.stages import StageBase


def stage_names() -> set[str]:
    names, todo = set(), list(StageBase.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        names.add(cls.name)
    return names


class Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(record.msg)


class App:
    def __init__(self) -> None:
        self.event_logger = EventLogger()
        self.event_logger.register_event_schema(SCHEMA)
        self.caught = Caught()
        self.event_logger.register_handler(self.caught)


async def reported(op: Operation, reports: list[tuple[str, dict]]) -> list[dict]:
    app = App()
    report = Events(app, logging.getLogger("test")).progress(op)
    for phase, detail in reports:
        report(phase, detail)
    await asyncio.sleep(0)  # the reports land on the loop
    await asyncio.sleep(0)
    return [e for e in app.caught.events if e.get("__schema__") == EVENT_SCHEMA_ID]


async def test_each_stage_of_the_helper_is_reported_within_a_phase_the_ui_knows():
    names = stage_names()
    assert {"dump", "verify", "publish", "stage", "kill", "restore", "cuda_checkpoint",
            "cuda_restore", "files"} <= names  # the stages were found
    reports = [(n, {"state": s}) for n in sorted(names) for s in ("started", "done")]
    events = await reported(Operation("restore", "k"), reports)
    assert len(events) == len(reports)  # none dropped by the schema
    assert {e["phase"] for e in events} <= {"dump", "gpu", "kill", "restore"}


async def test_a_step_within_a_phase_keeps_the_bar_where_it_was():
    op = Operation("snapshot", "k")
    events = await reported(op, [("dump", {}), ("verify", {"state": "started"}),
                                 ("cuda_resume", {"state": "done"}),
                                 ("store", {"percent": 75.0})])
    assert [(e["phase"], e["percent"]) for e in events] == [
        ("dump", PHASE_PERCENT["dump"]), ("dump", PHASE_PERCENT["dump"]),
        ("dump", PHASE_PERCENT["dump"]), ("store", 75.0)]
