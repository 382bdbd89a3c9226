"""Thread rules (engine/heads.py): where a snapshot goes, and when a kernel is unchanged."""

from __future__ import annotations

from infinijup.engine.heads import Head, plan_snapshot, unchanged_since


def test_a_fresh_kernel_starts_a_new_root_next_to_its_thread():
    plan = plan_snapshot(Head(commit=None, thread="main"), {"main": "c2"}, None)
    assert (plan.thread, plan.parents, plan.expected_tip) == ("main-1", (), None)
    # asked for by name: the named thread has history, so a new one next to it
    plan = plan_snapshot(Head(commit=None, thread="main"), {"exp": "c2"}, "exp")
    assert (plan.thread, plan.parents, plan.expected_tip) == ("exp-1", (), None)
    # a notebook without snapshots: its first goes on main
    plan = plan_snapshot(Head(commit=None, thread="main"), {}, None)
    assert (plan.thread, plan.parents, plan.expected_tip) == ("main", (), None)


def test_a_kernel_on_its_tip_continues_the_thread():
    plan = plan_snapshot(Head(commit="c2", thread="main"), {"main": "c2"}, None)
    assert (plan.thread, plan.parents, plan.expected_tip) == ("main", ("c2",), "c2")


def _meta(count, names, *, truncated=False):
    return {"execution_count": count,
            "variables": {"items": [{"name": n, "changed": False} for n in names],
                          "truncated": truncated}}


def _described(names, changed=(), *, truncated=False):
    return {"variables": {"items": [{"name": n, "changed": n in changed} for n in names],
                          "truncated": truncated}}


def test_unchanged_only_when_nothing_says_otherwise():
    parent = _meta(7, ["a", "b"])
    assert unchanged_since(parent, 7, _described(["a", "b"]))
    assert not unchanged_since(parent, 8, _described(["a", "b"]))  # a cell ran
    assert not unchanged_since(parent, 7, _described(["a", "b"], changed={"b"}))
    assert not unchanged_since(parent, 7, _described(["a"]))  # b was deleted
    assert not unchanged_since(parent, 7, _described(["a", "b", "c"]))  # c is new
    assert not unchanged_since(parent, 7, _described(["a", "b"], truncated=True))
    assert not unchanged_since(_meta(7, ["a", "b"], truncated=True), 7, _described(["a", "b"]))
    assert not unchanged_since(_meta(None, ["a", "b"]), None, _described(["a", "b"]))
    assert not unchanged_since({"execution_count": 7}, 7, _described(["a", "b"]))
