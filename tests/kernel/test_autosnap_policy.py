"""The rule of automatic snapshots (kernel_magics/autosnap.py), alone: no kernel needed."""

from __future__ import annotations

from infinijup.kernel_magics.autosnap import Settings, decide, parse


def test_a_quick_cell_is_not_snapshotted_a_long_one_is():
    on = Settings(on=True, share=0.05, after_s=60.0)
    assert decide(0.001, 0.3, on)[0] is False  # 1 ms against a 0.3 s pause
    assert decide(3.0, 0.3, on)[0] is False  # 10% of the cell: too much
    assert decide(6.0, 0.3, on)[0] is True  # 5%: taken
    assert decide(61.0, 30.0, on)[0] is True  # past after_s: always
    took, why = decide(0.5, 0.3, on)
    assert not took and why.startswith("too quick")


def test_off_takes_nothing():
    assert decide(600.0, 0.1, Settings(on=False))[0] is False


def test_settings_from_the_environment():
    s = parse("on,share=0.1,after=30")
    assert (s.on, s.share, s.after_s) == (True, 0.1, 30.0)
    assert parse(None).on is False
    assert parse("on,share=7,after=-1,junk").share == 0.05  # out of range: defaults kept
    assert parse("off").on is False
