"""What a lane has ahead of a newcomer, as plain numbers: the one input admission takes from the queues and
workers, so admission never calls back into the core that asked it.

`drain_seconds` is the single rule for "how long until the workers serving a lane work through so many
rows": the core's retry hints (queue full, shed, unmeetable) and admission's queue wait both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.lanes import LaneKey

MIN_RETRY_S: Final = 0.01
"""Shortest retry hint: below it a client would only spin."""


@dataclass(slots=True)
class Backlog:
    """A lane as a newcomer of a given priority finds it (one is built per arrival: a slotted class, not
    frozen, as `outcomes.ItemAnswer`)."""

    estimates: ServiceEstimates
    """The router's execution-time estimates (read, never changed, by admission)."""
    rows_ahead: int
    """Rows queued in the lane at the newcomer's priority or better."""
    workers_full: bool
    """Every worker serving the lane's version is full: none could take a batch now."""
    batch: int
    """The lane's largest batch (1 while the lane does not exist)."""
    workers: int
    """Accepting workers serving the lane's version (at least 1: the rule divides by it)."""

    def __init__(
        self, estimates: ServiceEstimates, rows_ahead: int, workers_full: bool, batch: int, workers: int
    ) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.estimates = estimates
        self.rows_ahead = rows_ahead
        self.workers_full = workers_full
        self.batch = batch
        self.workers = workers

    def drain_seconds(self, key: LaneKey, rows: int) -> float:
        """`drain_seconds` for this lane."""
        return drain_seconds(self.estimates, key, rows, self.batch, self.workers)


def drain_seconds(estimates: ServiceEstimates, key: LaneKey, rows: int, batch: int, workers: int) -> float:
    """Estimated time for `workers` serving `key` to work through `rows` in batches of `batch` rows."""
    return drain_time(
        estimates.batch_seconds(key.model, key.version, batch, shape=key.shape), rows, batch, workers
    )


def drain_time(per_batch_s: float, rows: int, batch: int, workers: int) -> float:
    """`drain_seconds` once a batch's time, `per_batch_s`, is known (admission knows it already)."""
    return max(MIN_RETRY_S, math.ceil(rows / batch) * per_batch_s / workers)
