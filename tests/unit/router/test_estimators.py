"""The online latency model t(n) = a + b·n."""

from __future__ import annotations

import pytest

from router.policy.estimators import DEFAULT_SECONDS, ServiceEstimates


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
