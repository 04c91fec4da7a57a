"""Which worker gets a batch: the router's view of worker slots, and the choice policy.

Invariants:
- a worker holds at most `capacity` batches from this router at once (2 by default, so the next batch's
  transfer overlaps the current compute);
- only `accepting` workers (registered ready and stream connected, not draining) receive new batches;
- `reserve`/`release` are paired by the dispatcher, once per batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass
class WorkerSlot:
    """What the router knows about one worker's load."""

    worker_id: str
    models: frozenset[tuple[str, str]]
    capacity: int
    accepting: bool = True
    in_flight_batches: int = 0
    in_flight_rows: int = field(default=0)

    @property
    def has_free_slot(self) -> bool:
        """Whether one more batch may be sent now."""
        return self.accepting and self.in_flight_batches < self.capacity


class LeastLoaded:
    """Fewest batches in flight, then fewest rows, then name (deterministic ties)."""

    def choose(self, candidates: Iterable[WorkerSlot]) -> WorkerSlot | None:
        """The least-loaded worker with a free slot, or None."""
        free = [w for w in candidates if w.has_free_slot]
        if not free:
            return None
        return min(free, key=lambda w: (w.in_flight_batches, w.in_flight_rows, w.worker_id))


class WorkerPool:
    """Slots of every known worker, indexed by the (model, version) pairs they serve."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerSlot] = {}

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(list(self._workers.values()))

    def get(self, worker_id: str) -> WorkerSlot | None:
        """The slot of a worker, if known."""
        return self._workers.get(worker_id)

    def add(self, worker_id: str, models: Iterable[tuple[str, str]], capacity: int) -> WorkerSlot:
        """Register a worker (or refresh its models and capacity, keeping its in-flight counts)."""
        slot = self._workers.get(worker_id)
        if slot is None:
            slot = WorkerSlot(worker_id, frozenset(models), capacity)
            self._workers[worker_id] = slot
        else:
            slot.models = frozenset(models)
            slot.capacity = capacity
        return slot

    def remove(self, worker_id: str) -> None:
        """Forget a worker."""
        self._workers.pop(worker_id, None)

    def set_accepting(self, worker_id: str, accepting: bool) -> None:
        """Open or close a worker to new batches (draining, stream down)."""
        slot = self._workers.get(worker_id)
        if slot is not None:
            slot.accepting = accepting

    def serving(self, model: str, version: str) -> list[WorkerSlot]:
        """Accepting workers that have this model version loaded."""
        return [w for w in self._workers.values() if w.accepting and (model, version) in w.models]

    def reserve(self, worker_id: str, rows: int) -> None:
        """Account for a batch sent to the worker."""
        slot = self._workers[worker_id]
        slot.in_flight_batches += 1
        slot.in_flight_rows += rows

    def release(self, worker_id: str, rows: int) -> None:
        """Account for a batch answered (or lost) by the worker."""
        slot = self._workers.get(worker_id)
        if slot is not None:
            slot.in_flight_batches -= 1
            slot.in_flight_rows -= rows
