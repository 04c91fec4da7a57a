"""The batching rule: what may share one batch, and which waiting batches run as one forward.

Rule 1: every place that groups work into a batch asks `BatchFill.take` — the router's cut
(router/policy/lanes.py `Lane.pop_batch`), the worker's merge (`next_forward`, called by
worker/device_thread.py), the executor's regroup into forwards (worker/executor.py) and the simulated
worker (bench/sim/workers.py, which calls `next_forward` as the real worker does). So a change to what
fits a batch is made here once, and the simulator judges the rule the cluster runs.

What fits: the first member always does (a batch is never empty; one member over a limit goes alone);
each later one while the summed rows stay within `max_rows`, the summed costs (rows x padded length:
common/buckets.py `row_cost`) within `max_cost` and the summed wire bytes within `max_bytes`, each
limit that is set.

Which waiting batches run together (`next_forward`), when the device is free, oldest first:
- the oldest waiting batch runs now: nothing is held back to wait for a merge partner, and nothing that
  arrives later runs before it;
- it is joined by every later waiting batch with the same key (on a worker: model, version, requested
  outputs and padded input shape) that still fits, in arrival order (first fit), under the oldest
  batch's limits: a merge never builds a forward the model's limits forbid;
- a batch without a key runs alone.
A batch that joins overtakes the unrelated batches between it and the oldest; they wait only the extra
time its rows add to the forward.

Pure: no clock, no I/O, no threads; the callers own their queues.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one batch may hold: a model's `max_batch_size` rows, and optionally its `max_batch_cost` and
    (on the router's stream) a byte budget."""

    max_rows: int
    max_cost: int | None = None
    """Cap on the summed costs (rows x padded length); None: rows alone limit the batch."""
    max_bytes: int | None = None
    """Cap on the summed wire bytes, so a batch and its answer fit one stream message; None: no cap."""

    def most_rows(self, row_cost: int) -> int:
        """The most rows of `row_cost` each one batch holds by rows and cost (at least one: a first member
        always fits)."""
        if self.max_cost is None:
            return self.max_rows
        return max(1, min(self.max_rows, self.max_cost // row_cost))


class BatchFill:
    """A batch being filled under `limits`: its running totals, and whether one more member fits."""

    __slots__ = ("bytes", "cost", "limits", "members", "rows")

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self.members = 0
        self.rows = 0
        self.cost = 0
        self.bytes = 0

    def take(self, rows: int, cost: int = 0, size: int = 0) -> bool:
        """Add a member of `rows` rows, `cost` and `size` bytes if it fits (module docstring); whether it
        was added. The first member is always added."""
        if self.members:
            limits = self.limits
            if (
                self.rows + rows > limits.max_rows
                or (limits.max_cost is not None and self.cost + cost > limits.max_cost)
                or (limits.max_bytes is not None and self.bytes + size > limits.max_bytes)
            ):
                return False
        self.members += 1
        self.rows += rows
        self.cost += cost
        self.bytes += size
        return True


@dataclass(frozen=True, slots=True)
class Candidate:
    """A waiting batch as the merge sees it: its key (None: it runs alone), its rows and cost, and the
    limits of a forward of its model."""

    key: Hashable | None
    rows: int
    cost: int
    limits: BatchLimits


RUNS_ALONE: Final = Candidate(None, 0, 0, BatchLimits(0))
"""A batch that merges with nothing."""


def next_forward(waiting: Sequence[Candidate]) -> list[int]:
    """Positions in `waiting` (oldest first) of the batches to run now as one forward: the oldest, then
    each later batch with its key that still fits (module docstring). Empty only when nothing waits."""
    if not waiting:
        return []
    head = waiting[0]
    if head.key is None:
        return [0]
    fill = BatchFill(head.limits)
    fill.take(head.rows, head.cost)
    chosen = [0]
    for index in range(1, len(waiting)):
        candidate = waiting[index]
        if candidate.key == head.key and fill.take(candidate.rows, candidate.cost):
            chosen.append(index)
    return chosen
