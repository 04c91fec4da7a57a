"""The demand a router publishes: decaying rates under a fake clock, when a change is material, and the
bounds on what is written and read."""

from __future__ import annotations

import json
import math

import pytest

from sluice_inference.router.policy.demand import (
    MAX_RECORD_BYTES,
    MAX_TENANTS,
    NO_DEMAND,
    Demand,
    DemandMeter,
    changed,
    publish_interval_s,
)


def steady(meter: DemandMeter, tenant: str, rate: float, start: float, seconds: float) -> float:
    """`rate` attempts per second of `tenant` from `start` for `seconds`; returns the end time."""
    count = round(rate * seconds)
    for k in range(count):
        meter.note(tenant, start + k / rate)
    return start + count / rate


def test_a_steady_rate_is_measured_and_a_step_is_followed_within_three_windows() -> None:
    meter = DemandMeter(window_s=0.5)
    end = steady(meter, "t", 100, 0.0, 5.0)
    assert meter.current(end).of("t") == pytest.approx(100, rel=0.02)
    assert meter.current(end).total == pytest.approx(100, rel=0.02)
    # the load stops: the rate decays without any event, 95 % of the way in three windows
    assert meter.current(end + 1.5).of("t") == pytest.approx(100 * math.exp(-3), rel=0.02)
    end = steady(meter, "t", 40, end + 10, 1.5)  # from nothing to 40 req/s: 95 % of it in three windows
    assert 0.9 * 40 <= meter.current(end).of("t") <= 40


def test_idle_tenants_are_forgotten() -> None:
    meter = DemandMeter(window_s=0.5)
    meter.note("t", 0.0)
    assert meter.current(0.0).of("t") == pytest.approx(2.0)  # one request in a 0.5 s window
    assert meter.current(10.0).tenants == {}


def test_rates_stay_exact_across_long_runs_and_gaps() -> None:
    meter = DemandMeter(window_s=0.5)
    end = steady(meter, "t", 100, 0.0, 250.0)  # 500 windows: the sums rebase on the way
    assert meter.current(end).of("t") == pytest.approx(100, rel=0.02)
    meter.note("u", end + 1000.0)  # 2,000 windows of silence, then one request of a new tenant
    now = meter.current(end + 1000.0)
    assert now.of("u") == pytest.approx(2.0) and now.total == pytest.approx(2.0)
    assert "t" not in now.tenants  # decayed to nothing and forgotten
    assert meter.current(end + 999.0).of("u") == pytest.approx(2.0)  # time never runs back


@pytest.mark.parametrize(
    ("before", "after", "material"),
    [
        ({"t": 100.0}, {"t": 115.0}, False),  # 15 % of the larger: noise
        ({"t": 100.0}, {"t": 130.0}, True),
        ({"t": 0.3}, {"t": 0.2}, False),  # within 20 % + 0.1 req/s
        ({}, {"t": 1.0}, True),  # a first demand
        ({"t": 1.0}, {}, True),  # gone
        ({"t": 0.04}, {}, False),  # below MIN_RATE counts as none
    ],
)
def test_only_material_changes_are_published(
    before: dict[str, float], after: dict[str, float], material: bool
) -> None:
    old = Demand(before, sum(before.values()))
    new = Demand(after, sum(after.values()))
    assert changed(old, new) is material


def test_publishes_are_spaced_so_the_cluster_writes_at_most_100_a_second() -> None:
    assert publish_interval_s(0.25, 1) == 0.25
    assert publish_interval_s(0.25, 20) == 0.25
    assert publish_interval_s(0.25, 100) == pytest.approx(1.0)  # 100 routers x 1/s


def test_a_record_is_bounded_and_rounded_and_reads_back() -> None:
    busy = {f"tenant-{k:03d}-{'x' * 40}": 1000.0 / (k + 1) for k in range(200)}
    busy["y" * 500] = 5000.0  # an absurd name is left out
    record = Demand(busy, 12345.678).to_record()
    encoded = json.dumps(record)
    assert len(encoded) <= MAX_RECORD_BYTES
    read = Demand.from_record(json.loads(encoded))
    assert 0 < len(read.tenants) <= MAX_TENANTS
    assert read.of("tenant-000-" + "x" * 40) == 1000.0  # the busiest are the ones kept
    assert read.of("tenant-002-" + "x" * 40) == 333.0  # three significant digits
    assert read.total == 12300.0
    assert Demand({"t": 0.01}, 0.01).as_published().tenants == {}  # below MIN_RATE


@pytest.mark.parametrize(
    "record",
    [None, [], "x", {"tenants": "x"}, {"tenants": {"t": -1}}, {"tenants": {"t": "1"}},
     {"tenants": {"t": float("inf")}}, {"tenants": {"t": True}}],
)  # fmt: skip
def test_a_malformed_peer_record_counts_as_no_demand(record: object) -> None:
    demand = Demand.from_record(record)
    assert demand.tenants == {} and demand.total == 0.0


def test_a_peer_record_reads_at_most_max_tenants_and_a_missing_total_is_the_sum() -> None:
    demand = Demand.from_record({"tenants": {f"t{k}": 1.0 for k in range(1000)}})
    assert len(demand.tenants) == MAX_TENANTS and demand.total == MAX_TENANTS
    assert Demand({"a": 3.0, "b": 1.0}, 4.0).lower(Demand({"a": 2.0}, 9.0)) == Demand({"a": 2.0}, 4.0)
    assert NO_DEMAND.of("a") == 0.0
