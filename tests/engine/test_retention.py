"""Which automatic snapshots are thinned (engine/retention.py), alone."""

from __future__ import annotations

import random

from infinijup.engine.retention import Auto, Window, over_limits, to_thin

NOW = 100_000.0


def autos(*ages: float, size: int = 10) -> list[Auto]:
    return [Auto(f"c{i}", NOW - age, size) for i, age in enumerate(ages)]


def test_the_last_hour_stays_whole_then_one_per_slot():
    w = Window(keep_all_s=3600, every_s=600, max_count=1000, slack=0)
    # 5 in the last hour; 3 in one 10-minute slot two hours ago; 1 in another
    a = autos(10, 100, 1000, 2000, 3500, 7210, 7250, 7290, 9000)
    thinned = to_thin(a, NOW, w, set())
    assert thinned == ["c7", "c6"]  # of the slot's three the newest (c5) stays; oldest first
    assert "c8" not in thinned and not set(thinned) & {"c0", "c1", "c2", "c3", "c4"}


def test_the_count_and_bytes_limits_take_the_oldest_and_spare_what_is_protected():
    w = Window(keep_all_s=10**9, every_s=600, max_count=3, slack=0)
    a = autos(1, 2, 3, 4, 5)
    assert to_thin(a, NOW, w, set()) == ["c4", "c3"]
    assert to_thin(a, NOW, w, {"c4"}) == ["c3", "c2"]  # c4 is a kernel's HEAD: kept
    w = Window(keep_all_s=10**9, max_count=100, max_bytes=25, slack=0)
    assert to_thin(autos(1, 2, 3, 4), NOW, w, set()) == ["c3", "c2"]


def test_thinning_waits_for_a_batch_then_goes_below_the_limits():
    w = Window(keep_all_s=10**9, max_count=100)  # slack 10%: batches of 10
    assert w.batch == 10 and w.low_water() == (90, 0)
    assert to_thin(autos(*range(1, 101)), NOW, w, set()) == []  # at the limit: nothing
    over = to_thin(autos(*range(1, 102)), NOW, w, set())  # one over: down to 90
    assert over == [f"c{i}" for i in range(100, 89, -1)]
    # aged out of their slot (one per 10 minutes past the hour): only a batch at a time
    w = Window(keep_all_s=3600, every_s=600, max_count=100)
    nine = autos(*[4200 + i for i in range(10)])  # one slot: 9 of them can go
    assert to_thin(nine, NOW, w, set()) == []
    ten = autos(*[4200 + i for i in range(11)])
    assert len(to_thin(ten, NOW, w, set())) == 10
    # bytes: over the budget, thinned to 90% of it
    w = Window(keep_all_s=10**9, max_count=1000, max_bytes=100)
    assert to_thin(autos(*range(1, 11)), NOW, w, set()) == []  # 100 bytes: at the budget
    gone = to_thin(autos(*range(1, 12)), NOW, w, set())  # 110: down to 90
    assert gone == ["c10", "c9"]


def test_a_window_of_one_or_two_snapshots():
    assert Window(max_count=1).low_water()[0] == 1 and Window(max_count=2).low_water()[0] == 1
    w = Window(keep_all_s=10**9, max_count=2)
    assert to_thin(autos(1, 2), NOW, w, set()) == []
    assert to_thin(autos(1, 2, 3), NOW, w, set()) == ["c2", "c1"]


def session(window: Window, seed: int = 30) -> tuple[int, int]:
    """500 cells, one automatic snapshot each (sizes 10 KiB-2 MiB), a pass after each: after
    every pass the snapshots not thinned are within the count and the bytes; the one the kernel
    stands on (protected) is never thinned. (passes that thinned, snapshots thinned)."""
    rng = random.Random(seed)
    live: list[Auto] = []
    passes = 0
    t = 0.0
    for i in range(500):
        t += rng.uniform(1, 20)
        live.append(Auto(f"a{i}", t, rng.randint(10 << 10, 2 << 20)))
        head = {live[-1].id}
        ids = to_thin(live, t, window, head)
        assert ids == sorted(ids, key=lambda c: int(c[1:]))  # oldest first
        assert not set(ids) & head
        if ids:
            passes += 1
            live = [a for a in live if a.id not in set(ids)]
        assert not over_limits(live, window), (window, i)
    return passes, 500 - len(live)


def test_a_session_stays_within_its_limits_after_every_pass_and_thins_in_batches():
    for window in (Window(keep_all_s=10**9, max_count=100, max_bytes=64 << 20),
                   Window(keep_all_s=600, every_s=60, max_count=40),
                   Window(keep_all_s=10**9, max_count=50)):
        passes, thinned = session(window)
        each, thinned_each = session(Window(**{**window.__dict__, "slack": 0}))
        assert thinned > 0 and thinned_each > 0
        # the gc after a thinning runs a few times less often than once per cell
        assert passes * 3 <= each, (window, passes, each)
