"""The online fetch-ratio correction (engine/gpu/adapt.py): no change before a window fills or
inside the dead band; up one step when the CPU finished last in most of a window, down when the GPU
did; never past its bounds; ratios 0 and 1 stay; counts are taken as running totals (deltas)."""

from __future__ import annotations

import pytest

from engine.gpu.adapt import RatioController


def test_moves_by_windows_toward_balance() -> None:
    c = RatioController(0.4, window=100, step=0.01)
    assert c.observe(1000, 1000) is None  # the first reading is the base
    assert c.observe(1080, 1019) is None  # 99 new: the window is not full
    assert c.observe(1080, 1020) == pytest.approx(0.41)  # 80 of 100 had the CPU last: fetch more
    assert c.observe(1130, 1070) is None  # 50 / 100: inside the band
    assert c.observe(1150, 1150) == pytest.approx(0.40)  # 20 / 100: fetch less
    assert c.ratio == pytest.approx(0.40)


def test_bounds_and_fixed_ratios() -> None:
    c = RatioController(0.975, window=10, step=0.01, ceil=0.98)
    c.observe(0, 0)
    assert c.observe(10, 0) == pytest.approx(0.98)
    assert c.observe(20, 0) is None and c.ratio == pytest.approx(0.98)
    for fixed in (0.0, 1.0):
        f = RatioController(fixed, window=1)
        assert f.observe(0, 0) is None and f.observe(100, 0) is None and f.ratio == fixed
