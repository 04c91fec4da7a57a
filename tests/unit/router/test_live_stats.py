"""router/live_stats.py: a model's last minute — rate, error ratio, SLO attainment and latency percentiles
(to the 5 % bin) — from samples folded into one-second slots, with the minute sliding as time goes on."""

from __future__ import annotations

import numpy as np
import pytest

from sluice_inference.router.live_stats import BIN_RATIO, FOLD_EVERY, WINDOW_S, LiveStats


def test_a_model_never_seen_reads_as_idle_and_fully_within_its_slo() -> None:
    window = LiveStats().window("mlp", 100.0)
    assert (window.request_rate, window.error_ratio, window.slo_attainment) == (0.0, 0.0, 1.0)


def test_rate_errors_and_percentiles_of_the_last_minute() -> None:
    stats = LiveStats()
    rng = np.random.default_rng(1)
    latencies = rng.lognormal(np.log(0.004), 0.6, 6000)
    for index, latency in enumerate(latencies):  # 100 a second for 60 s, every tenth one failed
        stats.record("mlp", 1000.0 + index / 100, float(latency), good=index % 10 != 0)
    window = stats.window("mlp", 1060.0)
    assert window.request_rate == pytest.approx(100.0, rel=0.02)
    assert window.error_ratio == pytest.approx(0.1, abs=1e-9)
    assert window.slo_attainment == pytest.approx(0.9, abs=1e-9)
    assert window.p50_s == pytest.approx(float(np.percentile(latencies, 50)), rel=BIN_RATIO - 1)
    assert window.p99_s == pytest.approx(float(np.percentile(latencies, 99)), rel=BIN_RATIO - 1)


def test_the_minute_slides_samples_older_than_it_stop_counting() -> None:
    stats = LiveStats()
    for index in range(3 * FOLD_EVERY):  # 3 minutes' worth, the slow ones first, folded as they come
        latency = 1.0 if index < FOLD_EVERY else 0.010
        stats.record("mlp", 1000.0 + index * (180.0 / (3 * FOLD_EVERY)), latency, good=True)
    window = stats.window("mlp", 1180.0)
    assert window.p99_s == pytest.approx(0.010, rel=BIN_RATIO - 1)  # the second's slow ones are gone
    assert window.request_rate == pytest.approx(3 * FOLD_EVERY / 180.0, rel=0.05)
    assert stats.window("mlp", 1180.0 + WINDOW_S + 1).request_rate == 0.0
    assert stats.models() == ["mlp"]


def test_a_young_window_divides_by_its_own_span_of_at_least_a_second() -> None:
    stats = LiveStats()
    for index in range(50):
        stats.record("mlp", 10.0 + index * 0.1, 0.002, good=True)  # 5 s of 10 a second
    assert stats.window("mlp", 15.0).request_rate == pytest.approx(10.0, rel=0.02)
    fresh = LiveStats()
    fresh.record("mlp", 10.0, 0.002, good=True)
    assert fresh.window("mlp", 10.0).request_rate == 1.0
