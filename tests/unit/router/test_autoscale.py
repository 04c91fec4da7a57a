"""The desired_workers math and its hysteresis, under a fake clock."""

from __future__ import annotations

from sluice_inference.router.policy.autoscale import Autoscaler, ModelLoad, ScalingPolicy, base_workers

POLICY = ScalingPolicy(target_utilization=0.5, scale_down_window_s=60.0, min_workers=1, max_workers=10)


def load(rate: float, attainment: float = 1.0, ready: int = 1) -> ModelLoad:
    return ModelLoad(rows_per_s=rate, seconds_per_row=0.01, ready_workers=ready, slo_attainment=attainment)


def test_workers_cover_the_load_at_the_target_utilisation() -> None:
    assert base_workers(load(0), POLICY) == 0
    assert base_workers(load(50), POLICY) == 1  # 50 rows/s x 10 ms = 0.5 busy: exactly one at 50 %
    assert base_workers(load(51), POLICY) == 2
    assert base_workers(load(260), POLICY) == 6


def test_missing_the_slo_asks_for_one_more_than_ready() -> None:
    scaler = Autoscaler(POLICY)
    assert scaler.raw(load(20, attainment=0.95, ready=3)) == 4
    assert scaler.raw(load(20, attainment=1.0, ready=3)) == 1


def test_bounds() -> None:
    scaler = Autoscaler(POLICY)
    assert scaler.raw(load(10_000)) == 10
    assert scaler.raw(load(0, ready=0)) == 0  # no traffic, nothing running: nothing needed
    assert scaler.raw(load(1, ready=0)) == 1


def test_scale_up_is_immediate_and_scale_down_waits_a_full_window() -> None:
    scaler = Autoscaler(POLICY)
    assert scaler.desired("m", load(260), now=0.0) == 6
    assert scaler.desired("m", load(40), now=30.0) == 6  # lull: still within the window
    assert scaler.desired("m", load(40), now=59.0) == 6
    assert scaler.desired("m", load(40), now=61.0) == 1  # the peak has left the window
    assert scaler.desired("m", load(500), now=62.0) == 10  # up again at once
