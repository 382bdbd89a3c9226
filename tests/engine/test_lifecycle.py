"""The kernel lifecycle's moves (engine/lifecycle.py) and the step runner (engine/steps.py),
without a server: what may follow what, what waits, and what undoes."""

import asyncio

import pytest

from infinijup.engine import lifecycle as lc
from infinijup.engine.steps import Steps
from infinijup.errors import Conflict


def test_every_state_can_get_back_to_running():
    """No state is a dead end: from each, some path of allowed moves reaches running."""
    for start in lc.MOVES:
        seen, todo = {start}, [start]
        while todo:
            for nxt in lc.MOVES[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert lc.RUNNING in seen, start


async def test_a_snapshot_stores_while_the_kernel_runs_and_the_next_operation_waits():
    life = lc.Lifecycle()
    turn = await life.begin("k", lc.SNAPSHOTTING)
    op = lc.Operation("snapshot", "k")
    life.start_operation(op)
    assert not life.holds("k") and life.busy("k") and life.shown("k") == lc.RUNNING
    turn.to(lc.STORING)
    waiting = asyncio.ensure_future(life.begin("k", lc.RESTORING))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # queued behind the store
    life.end_operation(op)
    turn.to(lc.RUNNING)
    second = await asyncio.wait_for(waiting, 5)
    assert life.state("k") == lc.RESTORING and life.holds("k")
    assert life.last("k")["op"] == "snapshot"
    second.to(lc.RUNNING)
    assert not life.busy("k")


async def test_a_settling_kernel_runs_cells_and_the_next_move_waits_but_not_its_history():
    life = lc.Lifecycle()
    turn = await life.begin("k", lc.RESTORING)
    turn.to(lc.SETTLING)  # the kernel the restore replaced is kept until the memory is back
    assert not life.holds("k") and life.busy("k") and life.shown("k") == lc.RUNNING
    assert life.no_process_on_purpose("k")  # the restarter leaves a restored tree that ends
    await asyncio.wait_for(life.stored("k"), 1)  # nothing is being stored: history answers
    waiting = asyncio.ensure_future(life.begin("k", lc.SNAPSHOTTING))
    undoing = asyncio.ensure_future(life.settled("k"))
    await asyncio.sleep(0.01)
    assert not waiting.done() and not undoing.done()
    turn.to(lc.RUNNING)
    await asyncio.wait_for(undoing, 5)
    (await asyncio.wait_for(waiting, 5)).to(lc.RUNNING)


async def test_moves_the_table_does_not_allow_are_refused_with_the_state():
    life = lc.Lifecycle()
    turn = await life.begin("k", lc.HIBERNATING)
    life.start_operation(lc.Operation("snapshot", "k", phase="dump"))
    with pytest.raises(Conflict) as refused:
        await life.begin("k", lc.RESTORING)
    assert refused.value.reason == "operation_running"
    turn.to(lc.HIBERNATED)
    life.end_operation(life.operation("k"))
    with pytest.raises(Conflict) as refused:
        await life.begin("k", lc.SNAPSHOTTING)
    assert refused.value.reason == "kernel_hibernated"
    assert life.no_process_on_purpose("k") and life.holds("k")
    with pytest.raises(Conflict):
        life.move("k", lc.RUNNING)  # a hibernated kernel runs again only by waking
    wake = await life.begin("k", lc.WAKING)
    wake.back()
    assert life.state("k") == lc.HIBERNATED


async def test_every_move_is_heard_and_a_new_kernel_can_stand_in_for_a_hibernated_one():
    heard = []
    life = lc.Lifecycle(on_move=lambda k, old, new: heard.append((k, old, new)))
    life.stand_in_hibernated("k")
    turn = await life.begin("k", lc.WAKING)
    turn.to(lc.RUNNING)
    assert heard == [("k", "running", "hibernated"), ("k", "hibernated", "waking"),
                     ("k", "waking", "running")]
    busy = await life.begin("k", lc.RELEASING)
    with pytest.raises(Conflict):
        life.stand_in_hibernated("k")
    busy.back()


async def test_steps_undo_what_was_done_newest_first_and_keep_the_cause():
    undone = []

    async def fails():
        raise RuntimeError("the cause")

    async def undo_async():
        undone.append("b")

    def undo_that_fails():
        undone.append("c")
        raise ValueError("not this one")

    with pytest.raises(RuntimeError, match="the cause"):
        async with Steps() as step:
            await step("a", undo=lambda: undone.append("a"))
            await step("b", asyncio.sleep(0), undo=undo_async)
            await step("c", undo=undo_that_fails)
            await step("e", fails(), undo=lambda: undone.append("e"))
    assert undone == ["c", "b", "a"]


async def test_steps_that_all_succeed_undo_nothing():
    undone = []
    async with Steps() as step:
        assert await step("a", asyncio.sleep(0, result=7), undo=lambda: undone.append("a")) == 7
    assert undone == [] and step.done == ["a"]
