"""Which automatic snapshots are thinned (engine/retention.py), alone."""

from __future__ import annotations

from infinijup.engine.retention import Auto, Window, to_thin

NOW = 100_000.0


def autos(*ages: float, size: int = 10) -> list[Auto]:
    return [Auto(f"c{i}", NOW - age, size) for i, age in enumerate(ages)]


def test_the_last_hour_stays_whole_then_one_per_slot():
    w = Window(keep_all_s=3600, every_s=600, max_count=1000)
    # 5 in the last hour; 3 in one 10-minute slot two hours ago; 1 in another
    a = autos(10, 100, 1000, 2000, 3500, 7210, 7250, 7290, 9000)
    thinned = to_thin(a, NOW, w, set())
    assert thinned == ["c7", "c6"]  # of the slot's three the newest (c5) stays; oldest first
    assert "c8" not in thinned and not set(thinned) & {"c0", "c1", "c2", "c3", "c4"}


def test_the_count_and_bytes_limits_take_the_oldest_and_spare_what_is_protected():
    w = Window(keep_all_s=10**9, every_s=600, max_count=3)
    a = autos(1, 2, 3, 4, 5)
    assert to_thin(a, NOW, w, set()) == ["c4", "c3"]
    assert to_thin(a, NOW, w, {"c4"}) == ["c3", "c2"]  # c4 is a kernel's HEAD: kept
    w = Window(keep_all_s=10**9, max_count=100, max_bytes=25)
    assert to_thin(autos(1, 2, 3, 4), NOW, w, set()) == ["c3", "c2"]
