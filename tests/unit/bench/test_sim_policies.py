"""What the simulator shows about the router's policies (docs/batching.md), on the shipped scenarios.

Each test runs the router's own policy objects under virtual time and asserts a property that a worse
policy fails; the comments say which. Figures are deterministic for a seed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from sluice_inference.bench.sim.engine import simulate
from sluice_inference.bench.sim.plan import plan_run
from sluice_inference.bench.sim.scenario import SimScenario, Variant, load_sim_scenario

SCENARIOS = Path(__file__).resolve().parents[3] / "bench" / "scenarios"


def load(name: str, **overrides: Any) -> SimScenario:
    return load_sim_scenario(SCENARIOS / f"{name}.yaml", overrides)


def run(scenario: SimScenario, name: str = "run", **policy: Any) -> dict[str, Any]:
    return simulate(plan_run(scenario, Variant(name=name, policy=policy))).summary()


def p99(summary: dict[str, Any], cls: str | None = None) -> float:
    figures = summary["total"] if cls is None else summary["classes"][cls]
    value = figures["latency_ms"]["p99"]
    assert value is not None
    return float(value)


def test_long_inputs_in_their_own_lane_barely_delay_short_ones() -> None:
    hol = load("sim_hol")  # 0.1 x capacity: docs/batching.md shows where the 20 % bound stops holding
    short_only = simulate(plan_run(hol, Variant(name="short only", drop_classes=["long"]))).summary()
    lanes = run(hol)
    # lanes: the same short arrivals keep their p99 within 20 % and every one of them is answered in time
    assert p99(lanes, "short") <= 1.2 * p99(short_only, "short")
    assert lanes["classes"]["short"]["slo_pct"] >= 99.9


def test_one_padded_lane_fails_short_requests_where_lanes_do_not() -> None:
    # at 0.2 x both keep every short deadline (padded p99 ~3 x the lanes'); at 0.3 x padding breaks them
    busier = load("sim_hol", load=0.3, duration_s=5)
    lanes, padded = run(busier), run(busier, padded=True)
    assert lanes["classes"]["short"]["slo_pct"] >= 99.9
    assert padded["classes"]["short"]["slo_pct"] < 95  # each short row costs as a long one (measured 90)
    assert p99(padded, "short") > 3 * p99(lanes, "short")  # measured 94 vs 18 ms


def slow_share(summary: dict[str, Any]) -> float:
    """Rows per slow worker over rows per fast worker."""
    by_speed = summary["workers"]["by_speed"]
    slow, fast = by_speed["0.5"], by_speed["1"]
    return float((slow["rows"] / slow["workers"]) / (fast["rows"] / fast["workers"]))


def test_a_twice_slower_worker_gets_at_most_half_the_work_and_p99_beats_round_robin_under_load() -> None:
    busy = load("sim_slow_worker", load=0.3, duration_s=10)
    expected, robin = run(busy, scheduler="expected_completion"), run(busy, scheduler="round_robin")
    # measured ~0.04 vs ~0.47 (round robin hands out batches in turn, so near the speed-blind 0.5)
    assert slow_share(expected) <= 0.5 and slow_share(expected) < slow_share(robin) / 2
    assert p99(expected) < p99(robin)


def test_expected_completion_beats_round_robin_with_a_slow_worker() -> None:
    light = load("sim_slow_worker")
    expected = run(light, scheduler="expected_completion")
    robin = run(light, scheduler="round_robin")
    assert p99(expected) < 0.8 * p99(robin)
    assert slow_share(expected) <= 0.5  # the slow workers get less than their speed's share ...
    assert slow_share(robin) >= 0.7  # ... round robin hands them about as much as the fast ones
    assert expected["total"]["slo_pct"] >= robin["total"]["slo_pct"]


def test_adaptive_batching_costs_no_latency_at_low_load() -> None:
    light = load("sim_steady", load=0.05, duration_s=5)
    adaptive, timer = run(light, batcher="adaptive"), run(light, batcher="timer")
    assert adaptive["total"]["latency_ms"]["p50"] <= timer["total"]["latency_ms"]["p50"] + 0.05


@functools.cache
def overload_runs() -> dict[str, dict[str, Any]]:
    """sim_overload (1.5 x capacity) with each batcher."""
    overload = load("sim_overload", duration_s=3)
    return {batcher: run(overload, batcher=batcher) for batcher in ("adaptive", "timer")}


def test_adaptive_batching_keeps_throughput_under_overload() -> None:
    runs = overload_runs()
    adaptive, timer = runs["adaptive"], runs["timer"]
    assert adaptive["total"]["throughput_rps"] >= 0.99 * timer["total"]["throughput_rps"]
    assert adaptive["batches"]["mean_rows"] >= 0.95 * 32
    assert adaptive["classes"]["gold"]["slo_pct"] >= 99  # priority 1 is served first
    assert adaptive["total"]["shed_pct"] >= 25  # the excess is refused, with a status


@pytest.mark.parametrize("batcher", ["adaptive", "timer"])
def test_overload_keeps_goodput_at_capacity_and_runs_nothing_late(batcher: str) -> None:
    summary = overload_runs()[batcher]
    # admission budgets the full batch a request may ride in plus one ahead of it on the worker; budgeting
    # only its own rows let 3-7 % of arrivals be dispatched, run, and finish after their deadline
    assert summary["total"]["goodput_rps"] >= 0.95 * summary["capacity_rps"]
    assert summary["total"]["expired_pct"] <= 0.5
    assert summary["batches"]["late_rows_pct"] <= 0.5  # device time spent on answers that came back late


def test_holding_for_a_busy_worker_beats_the_timer_at_high_load() -> None:
    # the adaptive batcher keeps collecting while the receiving worker is busy: fuller batches, cut when
    # the worker is about to be free; the timer cuts at max_wait and queues them (measured 36 vs 46 ms p99)
    high = load("sim_steady", load=0.8, duration_s=2)
    adaptive, timer = run(high, batcher="adaptive"), run(high, batcher="timer")
    assert p99(adaptive) <= 0.9 * p99(timer)
    assert adaptive["total"]["latency_ms"]["p50"] <= 0.85 * timer["total"]["latency_ms"]["p50"]
    assert adaptive["total"]["slo_pct"] == timer["total"]["slo_pct"] == 100.0


@pytest.mark.xfail(
    strict=True,
    reason="known gap (docs/batching.md): with the hold now in the core, adaptive beats the timer on p50 "
    "everywhere and on p99 from 0.6 x, but at 0.3-0.5 x its p99 is still ~8-10 % above the timer's (15.6 vs "
    "13.6 ms here): its tail rides in the large batches a hold collects",
)
def test_adaptive_p99_is_no_worse_than_timer_at_moderate_load() -> None:
    moderate = load("sim_steady", load=0.3, duration_s=5)
    assert p99(run(moderate, batcher="adaptive")) <= p99(run(moderate, batcher="timer"))


def test_headroom_mode_trades_unused_budget_for_fuller_batches() -> None:
    light = load("sim_headroom", duration_s=10)
    adaptive, timer = run(light, batcher="adaptive"), run(light, batcher="timer")
    assert adaptive["batches"]["mean_rows"] >= 1.5 * timer["batches"]["mean_rows"]
    assert adaptive["workers"]["busy_mean"] <= 0.7 * timer["workers"]["busy_mean"]
    assert p99(adaptive) <= 0.25 * 200  # still well inside the 200 ms budget
    assert adaptive["total"]["slo_pct"] == 100.0


def test_failures_lose_only_what_was_on_the_lost_workers() -> None:
    failures = load("sim_failures", duration_s=12, load=0.2)  # the crash at 5 s, the hang at 10 s (+1 s)
    summary = run(failures)
    statuses = summary["total"]["rejected_by_status"]
    # the crashed worker's batches went elsewhere; what the hung one held ended at its deadline (the core
    # does not wait for the loss to be noticed); nothing else failed
    assert summary["batches"]["redispatched"] > 0
    assert statuses.get("UNAVAILABLE/worker_lost", 0) <= 2 * failures.model.max_batch_size
    assert set(statuses) <= {"UNAVAILABLE/worker_lost", "DEADLINE_EXCEEDED/expired_on_worker"}
    assert summary["total"]["slo_pct"] >= 95
