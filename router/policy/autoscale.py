"""The autoscaling signal: how many workers a model needs, with hysteresis (exported as
`sluice_autoscaler_desired_workers{model}` for the HPA / KEDA).

Math, per model:
- λ = arrival rate (rows/s) this router sees * the number of live routers (clients spread evenly), so every
  router exports an estimate of the whole cluster's need and the HPA takes the max over routers;
- s = t(B) / B = device time per row at the full batch B, from the learned latency model: a worker's
  capacity is B / t(B) rows/s. (Not the adaptive batcher's keep-up size: that size is by construction the
  one that keeps a worker just busy, so utilisation measured at it is always ~100 %.);
- base = ⌈ λ · s / u* ⌉ workers keep each at utilisation u* (`target_utilization`, default 0.7): the
  headroom absorbs bursts and the batcher's waiting;
- SLO guard: if the share of requests answered OK within their deadline over the last minute is below
  `slo_attainment` (default 0.99) while traffic is flowing, ask for one worker more than are ready;
- bounds: at least `min_workers` (1 while there is traffic), at most `max_workers`.
Hysteresis: scale-up is immediate; scale-down takes the maximum desired value seen over the last
`scale_down_window_s` (default 120 s, like the HPA's stabilization window), so a short lull never removes
a worker that the next burst needs. Workers are only removed by draining (SIGTERM / preStop), so no request
fails on the way down.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScalingPolicy:
    """Tunables (config `autoscale`)."""

    target_utilization: float = 0.7
    slo_attainment: float = 0.99
    scale_down_window_s: float = 120.0
    min_workers: int = 1
    max_workers: int = 1000


@dataclass(frozen=True)
class ModelLoad:
    """What the router observes about one model now."""

    rows_per_s: float
    seconds_per_row: float
    ready_workers: int
    slo_attainment: float


def base_workers(load: ModelLoad, policy: ScalingPolicy) -> int:
    """Workers needed to serve the load at the target utilisation (0 without traffic)."""
    if load.rows_per_s <= 0:
        return 0
    return math.ceil(load.rows_per_s * load.seconds_per_row / policy.target_utilization - 1e-9)


@dataclass
class Autoscaler:
    """Desired worker counts per model, stabilised over time."""

    policy: ScalingPolicy = field(default_factory=ScalingPolicy)
    _history: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def raw(self, load: ModelLoad) -> int:
        """The instantaneous target, before stabilisation."""
        wanted = base_workers(load, self.policy)
        if load.rows_per_s > 0 and load.slo_attainment < self.policy.slo_attainment:
            wanted = max(wanted, load.ready_workers + 1)
        floor = (
            self.policy.min_workers
            if load.rows_per_s > 0
            else min(self.policy.min_workers, load.ready_workers)
        )
        return max(floor, min(self.policy.max_workers, wanted))

    def desired(self, model: str, load: ModelLoad, now: float) -> int:
        """The stabilised target: up at once, down only after a full window of lower values."""
        history = self._history.setdefault(model, deque())
        history.append((now, self.raw(load)))
        while history and history[0][0] < now - self.policy.scale_down_window_s:
            history.popleft()
        return max(value for _, value in history)
