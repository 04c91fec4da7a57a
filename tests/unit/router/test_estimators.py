"""The online latency model t(n) = a + b·n, and the best-case floor beside it."""

from __future__ import annotations

import math

import pytest

from sluice_inference.router.policy.estimators import DEFAULT_SECONDS, MAX_ANCHORS, BestCase, ServiceEstimates


def test_fit_recovers_a_linear_profile() -> None:
    estimates = ServiceEstimates()
    for _ in range(30):
        for rows in (1, 8, 32):
            estimates.observe("m", "1", rows, 0.005 + 0.0005 * rows)
    assert estimates.batch_seconds("m", "1", 16) == pytest.approx(0.013, rel=1e-3)


def test_warmup_seeds_until_real_reports_arrive_and_then_drift_is_followed() -> None:
    estimates = ServiceEstimates()
    estimates.seed("m", "1", {1: 0.002, 32: 0.018})
    assert estimates.batch_seconds("m", "1", 1) == pytest.approx(0.002, rel=1e-3)
    for _ in range(200):  # the device got twice as slow
        estimates.observe("m", "1", 1, 0.004)
        estimates.observe("m", "1", 32, 0.036)
    assert estimates.batch_seconds("m", "1", 32) == pytest.approx(0.036, rel=0.05)  # the prior pulls a little
    estimates.seed("m", "1", {1: 1.0})  # a later seed never overrides measurements
    assert estimates.batch_seconds("m", "1", 1) == pytest.approx(0.004, rel=0.05)


def test_unknown_model_uses_the_prior_and_coefficients_never_go_negative() -> None:
    estimates = ServiceEstimates()
    assert estimates.batch_seconds("x", "1", 10) == DEFAULT_SECONDS
    for rows, seconds in ((1, 0.010), (10, 0.001)):  # noisy: time falls with size
        estimates.observe("x", "1", rows, seconds)
    one, many = estimates.batch_seconds("x", "1", 1), estimates.batch_seconds("x", "1", 1000)
    assert one >= 0 and many >= one  # a ≥ 0 and b ≥ 0: no negative time, none that shrinks with size


def test_each_lane_shape_learns_its_own_cost_per_row() -> None:
    estimates = ServiceEstimates()
    short, long = (("x", (16,)),), (("x", (256,)),)
    for _ in range(10):
        estimates.observe("m", "1", 8, 0.004, shape=short)
        estimates.observe("m", "1", 1, 0.008, shape=long)
    assert estimates.batch_seconds("m", "1", 8, shape=short) == pytest.approx(0.004, rel=0.01)
    assert estimates.batch_seconds("m", "1", 1, shape=long) == pytest.approx(0.008, rel=0.01)


def test_best_case_is_the_fastest_seen_and_load_never_raises_it() -> None:
    estimates = ServiceEstimates()
    assert estimates.best_case_seconds("m", "1", 1) == 0.0  # never timed: no floor
    estimates.seed("m", "1", {1: 0.011, 8: 0.026})
    assert estimates.best_case_seconds("m", "1", 1) == pytest.approx(0.011)
    assert estimates.best_case_seconds("m", "1", 4) == pytest.approx(0.011)  # no faster than 1 row
    assert estimates.best_case_seconds("m", "1", 8) == pytest.approx(0.026)
    for _ in range(200):  # load: every batch slow, and the learned estimate follows
        estimates.observe("m", "1", 8, 0.200)
    assert estimates.batch_seconds("m", "1", 8) > 0.1
    assert estimates.best_case_seconds("m", "1", 8) == pytest.approx(0.026)
    estimates.observe("m", "1", 4, 0.009)  # 4 rows in 9 ms: 1 row can go at least that fast
    assert estimates.best_case_seconds("m", "1", 1) == pytest.approx(0.009)
    assert estimates.best_case_seconds("m", "1", 8) == pytest.approx(0.026)  # says nothing about 8 rows
    estimates.seed("m", "1", {8: 0.020})  # a faster worker joined: its warm-up lowers the floor
    assert estimates.best_case_seconds("m", "1", 8) == pytest.approx(0.020)


def test_best_case_ignores_hostile_warmup_timings_and_bounds_its_anchors() -> None:
    best = BestCase()
    for rows, seconds in ((0, 0.001), (-3, 0.001), (2, -1.0), (2, math.nan), (2, math.inf)):
        best.anchor(rows, seconds)
    assert best.lowest == {1: math.inf} and best.seconds(10**9) == 0.0
    for rows in range(2, 10 * MAX_ANCHORS):
        best.anchor(rows, 0.010)
    assert len(best.lowest) == MAX_ANCHORS
    best.observe(5, math.nan)
    assert best.seconds(5) == pytest.approx(0.010)
