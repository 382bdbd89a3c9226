"""run_niced (engine/niced.py): the work runs in a fresh thread, nicer than the caller, and
threads it starts inherit that; the caller's own priority is left as it was."""

from __future__ import annotations

import os
import threading

import pytest

from infinijup.engine.niced import MAX_NICE, THREAD_NAME, run_niced


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_the_work_is_nicer_and_so_are_its_threads():
    mine = nice_of(threading.get_native_id())
    want = min(MAX_NICE, mine + 5)
    assert want > mine, "this test needs a process below the largest nice value"

    def work() -> tuple[int, int, str, int]:
        seen = {}

        def child() -> None:  # as the store's worker threads are started
            seen["child"] = nice_of(threading.get_native_id())

        t = threading.Thread(target=child)
        t.start()
        t.join()
        tid = threading.get_native_id()
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        return tid, nice_of(tid), name, seen["child"]

    tid, nice, name, child = run_niced(work, 5)
    assert tid != threading.get_native_id()
    assert (nice, child, name) == (want, want, THREAD_NAME)
    assert nice_of(threading.get_native_id()) == mine  # the caller's thread is untouched


def test_no_nice_runs_in_the_callers_thread_and_errors_come_back():
    assert run_niced(threading.get_native_id, 0) == threading.get_native_id()
    with pytest.raises(KeyError, match="gone"):
        run_niced(lambda: {}["gone"], 3)
