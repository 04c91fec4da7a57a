"""Per-model request rates, error ratios and latency percentiles over the last minute (for `sluice top`,
the admin API and the autoscaling signal's SLO input). Bounded: at most `MAX_SAMPLES` per model."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

WINDOW_S = 60.0
MAX_SAMPLES = 20_000


@dataclass
class _Series:
    samples: deque[tuple[float, float, bool]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))


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
        self._models.setdefault(model, _Series()).samples.append((now, latency_s, good))

    def window(self, model: str, now: float) -> ModelWindow:
        """The model's last `WINDOW_S` seconds."""
        series = self._models.get(model)
        recent = [s for s in series.samples if s[0] >= now - WINDOW_S] if series else []
        if not recent:
            return ModelWindow(0.0, 0.0, 0.0, 0.0, 1.0)
        span = max(1.0, min(WINDOW_S, now - recent[0][0]))
        latencies = np.array([s[1] for s in recent])
        good = sum(1 for s in recent if s[2])
        return ModelWindow(
            request_rate=len(recent) / span,
            error_ratio=1.0 - good / len(recent),
            p50_s=float(np.percentile(latencies, 50)),
            p99_s=float(np.percentile(latencies, 99)),
            slo_attainment=good / len(recent),
        )

    def models(self) -> list[str]:
        """Models with any recorded request."""
        return sorted(self._models)
