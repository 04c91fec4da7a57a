"""BusyWindow: the share of the last window spent busy, to within one slot, from explicit times."""

from __future__ import annotations

import pytest

from sluice_inference.worker.busy import BusyWindow


def window() -> BusyWindow:
    return BusyWindow(window_s=5.0, slots=20)  # what the runner uses: 0.25 s slots


def test_nothing_recorded_reads_zero() -> None:
    busy = window()
    assert busy.fraction(100.0) == 0.0


def test_busy_all_along_reads_exactly_one() -> None:
    busy = window()
    for step in range(200):  # 20 s of back-to-back 0.1 s forwards
        busy.add(100.0 + step * 0.1, 100.0 + (step + 1) * 0.1)
    assert busy.fraction(120.0) == pytest.approx(1.0)


def test_one_second_busy_then_idle_is_a_fifth_to_within_one_slot() -> None:
    busy = window()
    busy.add(100.0, 101.0)
    assert 1 / 5 <= busy.fraction(102.0) <= 1 / 4.75
    assert 1 / 5 <= busy.fraction(102.1) <= 1 / 4.75


def test_busy_time_leaves_the_window() -> None:
    busy = window()
    busy.add(100.0, 110.0)
    # At 112 the window covers 107.25-112 (19 whole slots and the current one, just begun): 2.75 s busy.
    assert busy.fraction(112.0) == pytest.approx(2.75 / 4.75)
    assert busy.fraction(115.5) == 0.0
    busy.add(116.0, 116.5)  # and it keeps counting after the ring emptied
    assert busy.fraction(117.0) == pytest.approx(0.5 / 4.75)


def test_a_span_recorded_after_a_later_query_still_counts() -> None:
    """The device thread measures a forward's end; the loop may read the fraction before it hears of it."""
    busy = window()
    assert busy.fraction(101.2) == 0.0
    busy.add(100.5, 101.0)
    assert busy.fraction(101.2) == pytest.approx(0.5 / (4.75 + 0.2))


def test_many_short_spans_half_busy() -> None:
    busy = window()
    for step in range(100_000):  # 1000 s of 5 ms forwards every 10 ms, read after each one
        busy.add(step * 0.01, step * 0.01 + 0.005)
        busy.fraction(step * 0.01 + 0.005)
    assert busy.fraction(1000.0) == pytest.approx(0.5, abs=0.01)
