"""Per-model request rates, error ratios and latency percentiles over the last minute (for `sluice top`,
the admin API and the autoscaling signal's SLO input).

Incremental: `record` appends one sample to a short list (per request, O(1)); the samples are folded into
one-second slots — a count, a good count and a latency histogram on fixed log-spaced bins — when the list
reaches `FOLD_EVERY` or a window is read. A `window` read sums at most `WINDOW_S` slots, whatever the
request rate: it used to scan and sort up to 20,000 raw samples (~3 ms here) per read. Percentiles are
read from the histogram: within `BIN_RATIO` of the exact value (bins 5 % wide, from `MIN_LATENCY_S`;
anything faster counts in the first bin, anything slower than `MAX_LATENCY_S` in the last).

Bounded: per model at most `WINDOW_S` slots of `BINS` counters and `FOLD_EVERY` pending samples; slots
older than the window are dropped as they fold.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

WINDOW_S = 60.0
FOLD_EVERY = 4096
"""Pending samples folded at once (also when a window is read)."""
MIN_LATENCY_S = 1e-5
MAX_LATENCY_S = 1e3
BIN_RATIO = 1.05
BINS = math.ceil(math.log(MAX_LATENCY_S / MIN_LATENCY_S) / math.log(BIN_RATIO)) + 1
_EDGES = MIN_LATENCY_S * BIN_RATIO ** np.arange(BINS)
"""Lower edge of each latency bin (bin 0 also holds anything faster)."""
_MIDDLES = _EDGES * math.sqrt(BIN_RATIO)
"""What a bin's samples read as: its geometric middle."""


@dataclass
class _Slot:
    """One second of one model's answers."""

    second: int
    first_s: float
    """Time of the slot's earliest sample (the window's span starts there when it is the oldest)."""
    count: int = 0
    good: int = 0
    latencies: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(BINS, np.int64))


@dataclass
class _Series:
    pending: list[tuple[float, float, bool]] = field(default_factory=list)
    slots: deque[_Slot] = field(default_factory=deque)
    """Oldest first, at most one per second of the window."""

    def fold(self, now: float) -> None:
        """Move the pending samples into their slots and drop slots older than the window."""
        pending, self.pending = self.pending, []
        if pending:
            times = np.fromiter((s[0] for s in pending), float, len(pending))
            latencies = np.fromiter((s[1] for s in pending), float, len(pending))
            good = np.fromiter((s[2] for s in pending), bool, len(pending))
            bins = np.clip(np.searchsorted(_EDGES, latencies, side="right") - 1, 0, BINS - 1)
            seconds = np.floor(times).astype(np.int64)
            for second in np.unique(seconds):
                mine = seconds == second
                slot = self._slot(int(second), float(times[mine].min()))
                slot.count += int(mine.sum())
                slot.good += int(good[mine].sum())
                slot.latencies += np.bincount(bins[mine], minlength=BINS)
        horizon = now - WINDOW_S
        while self.slots and self.slots[0].second + 1 <= horizon:
            self.slots.popleft()

    def _slot(self, second: int, first_s: float) -> _Slot:
        for slot in reversed(self.slots):  # samples arrive in time order: the newest slot, nearly always
            if slot.second == second:
                slot.first_s = min(slot.first_s, first_s)
                return slot
            if slot.second < second:
                break
        slot = _Slot(second, first_s)
        self.slots.append(slot)
        if len(self.slots) > 1 and self.slots[-2].second > second:  # a late sample: keep them ordered
            self.slots = deque(sorted(self.slots, key=lambda s: s.second))
        return slot


@dataclass(frozen=True)
class ModelWindow:
    """What one model's last minute looked like."""

    request_rate: float
    error_ratio: float
    p50_s: float
    p99_s: float
    slo_attainment: float


class LiveStats:
    """Outcomes of answered requests per model, with their latency and whether they made the deadline."""

    def __init__(self) -> None:
        self._models: dict[str, _Series] = {}

    def record(self, model: str, now: float, latency_s: float, good: bool) -> None:
        """One answered request (good: OK within its deadline)."""
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = _Series()
        series.pending.append((now, latency_s, good))
        if len(series.pending) >= FOLD_EVERY:
            series.fold(now)

    def window(self, model: str, now: float) -> ModelWindow:
        """The model's last `WINDOW_S` seconds (to the second: the oldest slot counts whole)."""
        series = self._models.get(model)
        if series is None:
            return ModelWindow(0.0, 0.0, 0.0, 0.0, 1.0)
        series.fold(now)
        count = sum(slot.count for slot in series.slots)
        if not count:
            return ModelWindow(0.0, 0.0, 0.0, 0.0, 1.0)
        good = sum(slot.good for slot in series.slots)
        histogram = np.sum([slot.latencies for slot in series.slots], axis=0)
        span = max(1.0, min(WINDOW_S, now - series.slots[0].first_s))
        return ModelWindow(
            request_rate=count / span,
            error_ratio=1.0 - good / count,
            p50_s=_percentile(histogram, count, 0.50),
            p99_s=_percentile(histogram, count, 0.99),
            slo_attainment=good / count,
        )

    def models(self) -> list[str]:
        """Models with any recorded request."""
        return sorted(self._models)


def _percentile(histogram: npt.NDArray[np.int64], count: int, q: float) -> float:
    """The latency below which a share `q` of the samples lie, to the bin (its middle)."""
    rank = max(1, math.ceil(q * count))
    index = int(np.searchsorted(np.cumsum(histogram), rank))
    return float(_MIDDLES[min(index, BINS - 1)])
