"""When to cut a batch from a lane: the decision returns either a cut or the time to look again.

`TimerBatcher` is the first policy (issue 2): work-conserving dispatch up to `max_batch_size`, with at most
`max_wait` of waiting. A lane is cut when
- it holds a full batch (rows ≥ max_batch_size), or
- its oldest request has waited `max_wait`, or
- the worker that would receive it is idle — waiting for a fuller batch while a device sits idle only adds
  latency; under load workers are busy, requests accumulate, and batches grow by themselves.
Otherwise the caller should come back at `oldest arrival + max_wait` (or earlier on any event).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.policy.lanes import Lane


@dataclass(frozen=True)
class Cut:
    """Cut a batch from the lane now."""

    reason: str


@dataclass(frozen=True)
class WakeAt:
    """Nothing to do before `when` unless an event arrives."""

    when: float


class TimerBatcher:
    """Cut on full, on max wait, or when the receiving worker is idle."""

    def decide(self, lane: Lane, now: float, *, worker_idle: bool) -> Cut | WakeAt:
        """Decide for a non-empty lane that has a worker with a free slot."""
        oldest = lane.oldest_arrival()
        if oldest is None:
            raise ValueError(f"lane {lane.key} is empty")
        if lane.rows >= lane.limits.max_batch_size:
            return Cut("full")
        if now - oldest >= lane.limits.max_wait_s:
            return Cut("max_wait")
        if worker_idle:
            return Cut("idle_worker")
        return WakeAt(oldest + lane.limits.max_wait_s)
