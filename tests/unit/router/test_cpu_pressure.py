"""The event loop's CPU pressure: the share of each interval its thread ran or waited to run, smoothed."""

from __future__ import annotations

import time

import pytest

from sluice_inference.router.cpu_pressure import SMOOTHING, CpuPressure, schedstat_times


class Thread:
    """A thread's scheduler times, advanced by hand, on a hand-set wall clock."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.ran = 0.0
        self.waited = 0.0

    def times(self) -> tuple[float, float]:
        return self.ran, self.waited

    def interval(self, seconds: float, *, ran: float, waited: float = 0.0) -> None:
        self.wall += seconds
        self.ran += ran
        self.waited += waited


def test_pressure_counts_running_and_waiting_for_the_cpu_alike() -> None:
    thread = Thread()
    pressure = CpuPressure(lambda: thread.wall, thread.times)
    assert pressure.sample() == 0.0  # the first sample only starts the interval
    thread.interval(0.2, ran=0.06, waited=0.1)  # wanted the CPU 80 % of the time
    assert pressure.sample() == pytest.approx(0.8)
    for _ in range(20):
        thread.interval(0.2, ran=0.06, waited=0.1)
        pressure.sample()
    assert pressure.value == pytest.approx(0.8)


def test_a_busier_interval_is_taken_at_once_and_a_quieter_one_part_of_the_way() -> None:
    """A load step out of idle must hold batches from the first busy interval on; one quiet interval in
    a busy spell must not drop the hold."""
    thread = Thread()
    pressure = CpuPressure(lambda: thread.wall, thread.times)
    pressure.sample()
    thread.interval(0.2, ran=0.02)
    assert pressure.sample() == pytest.approx(0.1)
    thread.interval(0.2, ran=0.5, waited=0.5)  # more than the interval: a coarse clock, read as all of it
    assert pressure.sample() == pytest.approx(1.0)
    thread.interval(0.2, ran=0.0)
    assert pressure.sample() == pytest.approx(1 - SMOOTHING)
    thread.interval(0.2, ran=0.0)
    assert pressure.sample() == pytest.approx((1 - SMOOTHING) ** 2)
    thread.interval(0.2, ran=0.18)
    assert pressure.sample() == pytest.approx(0.9)


def test_without_schedstat_the_threads_own_cpu_time_stands_in_for_good() -> None:
    thread = Thread()
    answers: list[tuple[float, float] | None] = [None]
    pressure = CpuPressure(lambda: thread.wall, lambda: answers[0], fallback=thread.times)
    pressure.sample()
    thread.interval(0.2, ran=0.1)
    answers[0] = (50.0, 50.0)  # schedstat appearing later is not mixed in: its totals would read a jump
    assert pressure.sample() == pytest.approx(0.5)


def test_the_kernel_reports_this_threads_running_time() -> None:
    before = schedstat_times()
    if before is None:
        pytest.skip("this kernel has no /proc/thread-self/schedstat")
    spun = time.thread_time() + 0.05
    while time.thread_time() < spun:
        pass
    after = schedstat_times()
    assert after is not None
    assert after[0] - before[0] >= 0.04 and after[1] >= before[1] >= 0.0
