"""When to cut a batch from a lane: the decision returns either a cut or the time to look again.

`TimerBatcher`: work-conserving dispatch up to `max_batch_size`, with at most `max_wait` of waiting, and
never past a queued request's budget. A lane is cut when
- it holds a full batch (rows ≥ max_batch_size), or
- its oldest request has waited `max_wait`, or
- waiting longer would make its most urgent request miss its deadline: the batch must start by that
  request's latest start time, earlier by the extra time a bigger batch takes to run, or
- the worker that would receive it is idle — waiting for a fuller batch while a device sits idle only adds
  latency; under load workers are busy, requests accumulate, and batches grow by themselves.
Otherwise the caller should come back at the earliest of those moments (or earlier on any event).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.policy.lanes import Lane

# Execution-time estimate for a batch of n rows of the lane being decided on.
BatchSeconds = Callable[[int], float]


@dataclass(frozen=True)
class Cut:
    """Cut a batch from the lane now."""

    reason: str


@dataclass(frozen=True)
class WakeAt:
    """Nothing to do before `when` unless an event arrives."""

    when: float


def _no_estimate(rows: int) -> float:
    return 0.0


class TimerBatcher:
    """Cut on full, on max wait, on the tightest budget, or when the receiving worker is idle."""

    def decide(
        self, lane: Lane, now: float, *, worker_idle: bool, batch_seconds: BatchSeconds = _no_estimate
    ) -> Cut | WakeAt:
        """Decide for a non-empty lane that has a worker with a free slot."""
        oldest = lane.oldest_arrival()
        if oldest is None:
            raise ValueError(f"lane {lane.key} is empty")
        limits = lane.limits
        if lane.rows >= limits.max_batch_size:
            return Cut("full")
        if now - oldest >= limits.max_wait_s:
            return Cut("max_wait")
        cut_by = oldest + limits.max_wait_s
        latest = lane.earliest_latest_start()
        if latest is not None:
            growth = batch_seconds(limits.max_batch_size) - batch_seconds(1)
            if now >= latest - growth:
                return Cut("deadline")
            cut_by = min(cut_by, latest - growth)
        if worker_idle:
            return Cut("idle_worker")
        return WakeAt(cut_by)
