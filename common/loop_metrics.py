"""Labelled counters and histograms for the metrics a router updates on every request, at a fraction of
prometheus_client's cost.

Why: prometheus_client takes a lock per value on every update, and a histogram's `observe` walks its
buckets in Python; the router made ~5 such updates per request, 10-15 µs of its own Python per request
(`bench/router_python.py` with them and with every update a no-op). Here an increment is one addition,
and an observation one `bisect` and two additions.

Invariants:
- a family is updated from one thread only, the owner's event loop (the router's data plane, driver and
  door all run there); the metrics endpoint's thread only reads. So there are no locks: a scrape that
  lands mid-update may see an observation's bucket before its sum, as prometheus_client's own per-value
  locks allow too;
- the exposition is prometheus_client's for the same metric (names, `_total`, `_bucket`/`_count`/`_sum`,
  `le` labels, counters' `_created`), through its public `*MetricFamily` types;
- label values are the caller's to bound (common/metrics.py `Bound` binds each child once).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterChild:
    """One counter series: a running total and when it was created."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount` (never negative: a counter only grows)."""
        if amount < 0:
            raise ValueError(f"counters only grow; cannot add {amount}")
        self.value += amount


class HistogramChild:
    """One histogram series: an observation count per bucket (not cumulative) and their sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        """Count `amount` in the first bucket whose upper bound is at least `amount`."""
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class _Family(Collector):
    """A labelled family registered on `registry`; children are made on first use of their values."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild | HistogramChild] = {}
        registry.register(self)

    def _child(self, values: tuple[str, ...]) -> CounterChild | HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, not {values}")
            child = self._children[values] = self._new_child()
        return child

    def _new_child(self) -> CounterChild | HistogramChild:
        raise NotImplementedError

    def _series(self) -> list[tuple[tuple[str, ...], CounterChild | HistogramChild]]:
        return list(self._children.items())  # a copy: the owner's thread may add a child meanwhile

    def collect(self) -> Iterable[Metric]:  # pragma: no cover - each family defines its own
        raise NotImplementedError


class LoopCounter(_Family):
    """A labelled counter (exported as prometheus_client's `Counter` is)."""

    def labels(self, *values: str) -> CounterChild:
        """The series for these label values."""
        child = self._child(values)
        assert isinstance(child, CounterChild)
        return child

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def collect(self) -> Iterable[Metric]:
        """The family with every series."""
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._series():
            assert isinstance(child, CounterChild)
            family.add_metric(values, child.value, created=child.created)
        return [family]


class LoopHistogram(_Family):
    """A labelled histogram over `buckets` (upper bounds; +Inf is added), exported as prometheus_client's
    `Histogram` is (no `_sum` when a bound is negative, as there)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be distinct, got {list(buckets)}")
        self._bounds = bounds if math.isinf(bounds[-1]) else [*bounds, math.inf]
        self._labels = [floatToGoString(b) for b in self._bounds]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> HistogramChild:
        """The series for these label values."""
        child = self._child(values)
        assert isinstance(child, HistogramChild)
        return child

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def collect(self) -> Iterable[Metric]:
        """The family with every series, buckets cumulative."""
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with_sum = self._bounds[0] >= 0
        for values, child in self._series():
            assert isinstance(child, HistogramChild)
            cumulative, buckets = 0, []
            for label, count in zip(self._labels, list(child.counts), strict=True):
                cumulative += count
                buckets.append((label, float(cumulative)))
            if with_sum:
                family.add_metric(values, buckets, child.sum)
            else:  # the family leaves out `_count` with `_sum`; prometheus_client keeps `_count`
                family.add_metric(values, buckets, None)
                labels = dict(zip(self.labelnames, values, strict=True))
                family.add_sample(f"{self.name}_count", labels, cumulative)
        return [family]
