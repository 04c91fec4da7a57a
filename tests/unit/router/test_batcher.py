"""Batching policies: when to cut, and when to look again."""

from __future__ import annotations

import pytest

from sluice_inference.router.policy.batcher import (
    NO_HOST_COST,
    AdaptiveBatcher,
    BatchContext,
    Cut,
    HostCost,
    TimerBatcher,
    WakeAt,
    host_keep_up_size,
)
from sluice_inference.router.policy.lane_stats import LaneStats
from sluice_inference.router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest

KEY = LaneKey("mlp", "1", (("input", (256,)),))


def lane_with(arrivals: list[float], rows: int = 1, max_batch: int = 4, max_wait: float = 0.01) -> Lane:
    lane = Lane(KEY, LaneLimits(max_batch_size=max_batch, max_wait_s=max_wait))
    for i, t in enumerate(arrivals):
        lane.push(QueuedRequest(i, KEY, rows, arrival=t, deadline=t + 1.0))
    return lane


def test_cuts_when_full_even_with_busy_worker() -> None:
    assert TimerBatcher().decide(lane_with([0.0] * 4), BatchContext(0.0, False)) == Cut("full")


def test_waits_until_oldest_reaches_max_wait() -> None:
    lane = lane_with([0.0, 0.002])
    assert TimerBatcher().decide(lane, BatchContext(0.005, False)) == WakeAt(0.01, lane.limits.max_batch_size)
    assert TimerBatcher().decide(lane, BatchContext(0.01, False)) == Cut("max_wait")


def test_work_conserving_when_worker_idle() -> None:
    assert TimerBatcher().decide(lane_with([0.0]), BatchContext(0.0, True)) == Cut("idle_worker")


def test_full_counts_rows_not_requests() -> None:
    assert TimerBatcher().decide(lane_with([0.0, 0.0], rows=2), BatchContext(0.0, False)) == Cut("full")


def test_pop_batch_never_exceeds_max_rows() -> None:
    lane = lane_with([0.0, 0.0, 0.0], rows=3, max_batch=4)
    first = lane.pop_batch(0.0)
    assert [r.request_id for r in first] == [0]
    assert len(lane) == 2 and lane.rows == 6


def linear(a: float, b: float):  # type: ignore[no-untyped-def]
    return lambda rows: a + b * rows


def stats_at_rate(rate: float, now: float = 10.0, healthy: bool = False) -> LaneStats:
    stats = LaneStats()
    for i in range(int(rate * 5)):  # 5 s of steady arrivals: the decayed count settles at the rate
        stats.arrived(now - 5.0 + i / rate)
    stats.healthy = healthy
    return stats


def adaptive_ctx(rate: float, *, idle: bool, workers: int = 1, healthy: bool = False) -> BatchContext:
    return BatchContext(10.0, idle, linear(0.010, 0.001), workers, stats_at_rate(rate, healthy=healthy))


def test_adaptive_target_is_one_when_lightly_loaded_and_full_when_overloaded() -> None:
    lane = lane_with([10.0], max_batch=32, max_wait=0.05)
    batcher = AdaptiveBatcher()
    assert batcher.target(lane, adaptive_ctx(5, idle=True)) == 1
    assert batcher.target(lane, adaptive_ctx(2000, idle=False)) == 32  # mu*b >= 1: overloaded


def test_adaptive_target_keeps_up_with_arrivals() -> None:
    lane = lane_with([10.0], max_batch=32, max_wait=0.05)
    # n = mu*a / (1 - mu*b) with mu = 500/s, a = 10 ms, b = 1 ms: 5 / 0.5 = 10
    assert AdaptiveBatcher().target(lane, adaptive_ctx(500, idle=False)) == pytest.approx(10, abs=1)
    assert AdaptiveBatcher().target(lane, adaptive_ctx(500, idle=False, workers=2)) == pytest.approx(4, abs=1)


def test_adaptive_idle_worker_waits_only_when_the_target_fills_in_time() -> None:
    lane = lane_with([10.0] * 3, max_batch=32, max_wait=0.05)
    assert isinstance(AdaptiveBatcher().decide(lane, adaptive_ctx(500, idle=True)), WakeAt)
    slow = lane_with([10.0] * 3, max_batch=32, max_wait=0.001)
    assert AdaptiveBatcher().decide(slow, adaptive_ctx(500, idle=True)) == Cut("idle_worker")


def test_adaptive_headroom_mode_grows_batches_only_when_latency_is_healthy() -> None:
    lane = lane_with([10.0], max_batch=32, max_wait=0.05)
    lane.limits = LaneLimits(max_batch_size=32, max_wait_s=0.05)
    unhealthy = AdaptiveBatcher().target(lane, adaptive_ctx(100, idle=True, workers=4))
    healthy = AdaptiveBatcher().target(lane, adaptive_ctx(100, idle=True, workers=4, healthy=True))
    assert unhealthy == 1 and healthy > unhealthy


def host_ctx(rate: float, host: HostCost) -> BatchContext:
    """An idle worker, t(n) = 10 ms + 1 ms·n, the lane at `rate`, and the router's own CPU as `host` says."""
    return BatchContext(10.0, True, linear(0.010, 0.001), 8, stats_at_rate(rate), host=host)


def test_the_routers_cpu_counts_only_while_it_is_the_constraint() -> None:
    lane = lane_with([10.0], max_batch=32, max_wait=0.05)
    # 8 workers keep up with 500 rows/s one row at a time; the router spends 2 ms per batch, 0.5 ms a row
    cost = {"batch_s": 0.002, "row_s": 0.0005, "rows_per_s": 1500.0}
    assert AdaptiveBatcher().target(lane, host_ctx(500, NO_HOST_COST)) == 1
    assert AdaptiveBatcher().target(lane, host_ctx(500, HostCost(**cost, constrained=False))) == 1
    # constrained: n = λh / (1 - Λc) = 500 x 2 ms / (1 - 1500 x 0.5 ms) = 1 / 0.25 = 4 rows
    assert AdaptiveBatcher().target(lane, host_ctx(500, HostCost(**cost, constrained=True))) == 4


def test_a_router_out_of_cpu_for_its_rows_alone_sends_full_batches() -> None:
    assert host_keep_up_size(500, HostCost(0.002, 0.001, True, 1000.0), 32) == 32
    assert host_keep_up_size(1, HostCost(0.002, 0.0005, True, 1000.0), 32) == 1  # a quiet lane: one row
    assert host_keep_up_size(500, HostCost(0.0, 0.0005, True, 1000.0), 32) == 1  # no per-batch cost


def pressed_ctx(pressure: float, now: float, *, idle: bool = True) -> BatchContext:
    """The adaptive batcher's context at 500 rows/s with the router's loop under `pressure`."""
    host = HostCost(pressure=pressure)
    return BatchContext(now, idle, linear(0.010, 0.001), 8, stats_at_rate(500, now), host=host)


@pytest.mark.parametrize(
    ("pressure", "hold"), [(0.0, 0.0), (0.5, 0.0), (0.7, 0.005), (0.9, 0.01), (1.0, 0.01)]
)
def test_cpu_pressure_holds_a_batch_for_a_share_of_its_max_wait(pressure: float, hold: float) -> None:
    assert HostCost(pressure=pressure).hold_s(0.01) == pytest.approx(hold)


@pytest.mark.parametrize(("pressure", "hold"), [(0.5, 0.0), (0.7, 0.015), (0.9, 0.03), (1.0, 0.03)])
def test_a_hold_factor_stretches_the_hold_past_max_wait_only_as_the_pressure_nears_saturation(
    pressure: float, hold: float
) -> None:
    assert HostCost(pressure=pressure, hold_factor=3.0).hold_s(0.01) == pytest.approx(hold)
    assert HostCost(pressure=pressure, hold_factor=3.0).hold_s(0.0) == 0.0  # batching off stays off


def test_a_saturated_router_holds_a_lane_past_its_max_wait_until_the_batch_is_full() -> None:
    def ctx(factor: float) -> BatchContext:
        host = HostCost(pressure=0.9, hold_factor=factor)
        return BatchContext(10.01, True, linear(0.010, 0.001), 8, stats_at_rate(1000, 10.01), host=host)

    lane = lane_with([10.0 + i * 0.001 for i in range(10)], max_batch=32, max_wait=0.005)
    assert isinstance(AdaptiveBatcher().decide(lane, ctx(1.0)), Cut)  # held max_wait: cut for the idle worker
    held = AdaptiveBatcher().decide(lane, ctx(3.0))  # 3 x max_wait from the oldest, for up to a full batch
    assert isinstance(held, WakeAt) and held.when == pytest.approx(10.015) and held.rows == 32
    full = lane_with([10.0 + i * 0.0003 for i in range(32)], max_batch=32, max_wait=0.005)
    assert AdaptiveBatcher().decide(full, ctx(3.0)) == Cut("full")


def test_an_idle_worker_is_no_reason_to_cut_while_the_routers_loop_is_short_of_cpu() -> None:
    lane = lane_with([10.0], max_batch=32, max_wait=0.01)
    batcher = AdaptiveBatcher()
    # 8 workers keep up one row at a time: without pressure the one-row target is met at once
    assert batcher.decide(lane, pressed_ctx(0.3, 10.0)) == Cut("target")
    # at 0.7 the oldest row is held for half its 10 ms max wait, for a full batch
    assert batcher.decide(lane, pressed_ctx(0.7, 10.0)) == WakeAt(10.005, 32)
    assert batcher.decide(lane, pressed_ctx(0.7, 10.004)) == WakeAt(10.005, 32)
    assert batcher.decide(lane, pressed_ctx(0.7, 10.005)) == Cut("target")  # held long enough


def test_the_cpu_hold_yields_to_a_full_batch_and_to_the_tightest_budget() -> None:
    assert AdaptiveBatcher().decide(lane_with([10.0] * 4, max_batch=4), pressed_ctx(1.0, 10.0)) == Cut("full")
    tight = Lane(KEY, LaneLimits(max_batch_size=32, max_wait_s=0.1))
    tight.push(QueuedRequest(0, KEY, 1, arrival=10.0, deadline=10.2, latest_start=10.06))
    decision = AdaptiveBatcher().decide(tight, pressed_ctx(1.0, 10.0))
    # the budget bound (its latest start less what a full batch adds, 31 ms) comes before the 100 ms hold
    assert isinstance(decision, WakeAt) and decision.rows == 32
    assert decision.when == pytest.approx(10.029)
    assert AdaptiveBatcher().decide(tight, pressed_ctx(1.0, decision.when)) == Cut("deadline")
