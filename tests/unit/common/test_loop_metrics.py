"""common/loop_metrics.py exports what prometheus_client would for the same updates, and refuses what a
counter or a label set cannot take."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from sluice_inference.common.loop_metrics import LoopCounter, LoopHistogram
from sluice_inference.common.metrics import LATENCY_BUCKETS, Bound

SIGNED = (-0.5, -0.1, 0.0, 0.1, 0.5, 1.0)
OBSERVED = [0.00005, 0.0001, 0.003, 0.003, 0.02, 0.7, 12.0, 1e9]
"""Below the first bound, on a bound, repeated, between bounds, past the last finite bound."""


def exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition without the `_created` series (their timestamps differ between the two)."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_the_exposition_is_prometheus_clients_for_the_same_updates() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counters: list[Counter | LoopCounter] = [Counter("c", "calls", ["model", "code"], registry=theirs),
                LoopCounter("c", "calls", ["model", "code"], registry=ours)]  # fmt: skip
    histograms: list[Histogram | LoopHistogram] = [
        Histogram("h", "latency", ["model"], buckets=LATENCY_BUCKETS, registry=theirs),
        LoopHistogram("h", "latency", ["model"], registry=ours, buckets=LATENCY_BUCKETS),
        Histogram("s", "error", ["model"], buckets=SIGNED, registry=theirs),
        LoopHistogram("s", "error", ["model"], registry=ours, buckets=SIGNED),
    ]
    for counter in counters:
        counter.labels("mlp", "OK").inc()
        counter.labels("mlp", "OK").inc(2.5)
        counter.labels("mlp", "UNAVAILABLE").inc()
    for histogram in histograms:
        for value in OBSERVED:
            histogram.labels("mlp").observe(value)
        histogram.labels("other").observe(-0.2)
    assert exposition(ours) == exposition(theirs)
    assert ours.get_sample_value("c_total", {"model": "mlp", "code": "OK"}) == 3.5
    assert ours.get_sample_value("h_bucket", {"model": "mlp", "le": "0.005"}) == 4.0
    assert ours.get_sample_value("s_sum", {"model": "mlp"}) is None  # a negative bound: no sum, as theirs


def test_counters_only_grow_and_label_sets_are_checked() -> None:
    counter = LoopCounter("c", "calls", ["model"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="only grow"):
        counter.labels("mlp").inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("mlp", "extra")
    assert counter.labels("mlp").value == 0.0


def test_bound_children_are_the_familys_own() -> None:
    histogram = LoopHistogram("h", "latency", ["model"], registry=CollectorRegistry(), buckets=(1.0, 2.0))
    bound = Bound(histogram)
    bound("mlp").observe(1.5)
    assert bound("mlp") is histogram.labels("mlp")
    assert histogram.labels("mlp").counts == [0, 1, 0]


def test_buckets_must_be_distinct() -> None:
    with pytest.raises(ValueError, match="distinct"):
        LoopHistogram("h", "latency", ["model"], registry=CollectorRegistry(), buckets=(1.0, 1.0))
