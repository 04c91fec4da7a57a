"""Which waiting batches the device runs next, together: the worker-side merge.

Routers batch separately, so a worker shared by several routers (or holding several batches of one) often
has small batches of the same model waiting at once. Each forward pays a fixed cost `a` (t(b) = a + c·b),
so running them as one forward serves the same rows sooner and frees the device earlier; each batch
still gets its own answer (worker/runner.py).

Rules, applied when the device is free to everything accepted and not yet run, oldest first:
- the oldest waiting batch runs now: nothing is held back to wait for a merge partner, and nothing that
  arrives later runs before it;
- it is joined by every later waiting batch with the same merge key — model, version, requested outputs
  and the one padded input shape all its valid items stack under (worker/padding.py `group_key`) — that
  still fits, in arrival order (first fit): the forward stays within the model's max_batch_size rows and
  its `max_batch_cost` (rows x padded length, as routers cut batches: a merge must not build a forward
  the model's limits forbid, e.g. several long sequences that the cost cap keeps apart);
- a batch without a key (its items need several padded shapes, none of them is valid, or its model is not
  served here) runs alone, as every batch did before merging.
A batch that joins overtakes the unrelated batches between it and the oldest; they wait only the extra
c·rows its rows add to the forward. Pure: no clock, no threads, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice_inference.common.buckets import row_cost
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.padding import ShapeKey


@dataclass(frozen=True)
class MergeKey:
    """What batches must share to stack into one forward."""

    model: str
    version: str
    outputs: tuple[str, ...]
    shape: ShapeKey


@dataclass(frozen=True)
class Candidate:
    """A waiting batch as the merge sees it: its key (None: runs alone), its valid rows, and the most
    rows one forward of its model may take."""

    key: MergeKey | None
    rows: int
    max_rows: int


def max_rows(config: ModelConfig, shape: ShapeKey) -> int:
    """The most rows of padded `shape` one forward of this model may take: max_batch_size, and fewer when
    max_batch_cost caps rows x padded length (0 when even one row is over the cap: it then runs alone)."""
    cap = config.max_batch_size
    if config.batching.max_batch_cost is not None:
        per_row = row_cost((spec.dims, dims) for spec, dims in zip(config.inputs, shape, strict=True))
        cap = min(cap, config.batching.max_batch_cost // per_row)
    return cap


RUNS_ALONE = Candidate(None, 0, 0)
"""A batch that merges with nothing."""


def next_forward(waiting: Sequence[Candidate]) -> list[int]:
    """Positions in `waiting` (oldest first) of the batches to run now as one forward: the oldest, then
    each later batch with its key that still fits. Empty only when nothing waits."""
    if not waiting:
        return []
    head = waiting[0]
    chosen = [0]
    if head.key is None:
        return chosen
    rows = head.rows
    for index in range(1, len(waiting)):
        candidate = waiting[index]
        if candidate.key == head.key and rows + candidate.rows <= head.max_rows:
            chosen.append(index)
            rows += candidate.rows
    return chosen
