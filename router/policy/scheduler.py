"""Which worker gets a batch: the router's view of worker slots, and the choice policies.

Policies (config `router.scheduler`): `expected_completion` (default) sends a batch to the worker that
should finish it first — its estimated backlog plus t(n) on *that* worker, learned from its own reports —
sampling two random candidates when more than `SAMPLE_ABOVE` could take it (the power of two choices keeps
the cost constant with thousands of workers while staying close to the best choice); `least_loaded`
(fewest batches in flight) and `round_robin` are kept as baselines. A worker twice as slow sees its
expected completion times double, so it receives about half the work.

Invariants:
- a worker holds at most `capacity` batches from this router at once (2 by default, so the next batch's
  transfer overlaps the current compute);
- only `accepting` workers (registered ready and stream connected, not draining) receive new batches;
- `reserve`/`release` are paired by the dispatcher, once per batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

SAMPLE_ABOVE = 4


@dataclass
class WorkerSlot:
    """What the router knows about one worker's load."""

    worker_id: str
    models: frozenset[tuple[str, str]]
    capacity: int
    accepting: bool = True
    in_flight_batches: int = 0
    in_flight_rows: int = field(default=0)
    busy_until: float = 0.0
    """When the batches already sent to it are expected to be done."""
    last_progress: float = 0.0
    """When it last answered a batch, or took work while idle: a worker holding work that makes no
    progress for too long is hung."""

    @property
    def has_free_slot(self) -> bool:
        """Whether one more batch may be sent now."""
        return self.accepting and self.in_flight_batches < self.capacity


@dataclass(frozen=True)
class Job:
    """The batch being placed: its size, the time, and its estimated duration on a given worker."""

    rows: int
    now: float
    seconds_on: Callable[[str], float]


class Chooser(Protocol):
    """A worker-choice policy."""

    def choose(self, candidates: Sequence[WorkerSlot], job: Job) -> WorkerSlot | None:
        """A worker with a free slot for `job`, or None when all are full."""
        ...


class LeastLoaded:
    """Fewest batches in flight, then fewest rows, then name (deterministic ties)."""

    def choose(self, candidates: Sequence[WorkerSlot], job: Job) -> WorkerSlot | None:
        """The least-loaded worker with a free slot, or None."""
        free = [w for w in candidates if w.has_free_slot]
        if not free:
            return None
        return min(free, key=lambda w: (w.in_flight_batches, w.in_flight_rows, w.worker_id))


class RoundRobin:
    """Free workers in turn, ignoring load and speed (a baseline)."""

    def __init__(self) -> None:
        self._last = ""

    def choose(self, candidates: Sequence[WorkerSlot], job: Job) -> WorkerSlot | None:
        """The next free worker after the one chosen last, by name."""
        free = sorted((w for w in candidates if w.has_free_slot), key=lambda w: w.worker_id)
        if not free:
            return None
        chosen = next((w for w in free if w.worker_id > self._last), free[0])
        self._last = chosen.worker_id
        return chosen


class ExpectedCompletion:
    """Earliest expected completion: max(now, busy_until) + t(n) on that worker."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random(0)

    def choose(self, candidates: Sequence[WorkerSlot], job: Job) -> WorkerSlot | None:
        """The free worker expected to finish `job` first (among two sampled when many are free)."""
        free = [w for w in candidates if w.has_free_slot]
        if not free:
            return None
        if len(free) > SAMPLE_ABOVE:
            free = self._rng.sample(free, 2)

        def finish(worker: WorkerSlot) -> tuple[float, str]:
            return (max(job.now, worker.busy_until) + job.seconds_on(worker.worker_id), worker.worker_id)

        return min(free, key=finish)


def make_chooser(name: str, rng: random.Random | None = None) -> Chooser:
    """The policy named in config."""
    choosers: dict[str, Callable[[], Chooser]] = {
        "expected_completion": lambda: ExpectedCompletion(rng),
        "least_loaded": LeastLoaded,
        "round_robin": RoundRobin,
    }
    if name not in choosers:
        raise ValueError(f"unknown scheduler {name!r} (choose from {', '.join(choosers)})")
    return choosers[name]()


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

    def reserve(self, worker_id: str, rows: int, now: float, seconds: float) -> None:
        """Account for a batch sent to the worker, expected to run for `seconds`."""
        slot = self._workers[worker_id]
        if not slot.in_flight_batches:
            slot.last_progress = now
        slot.in_flight_batches += 1
        slot.in_flight_rows += rows
        slot.busy_until = max(slot.busy_until, now) + seconds

    def release(self, worker_id: str, rows: int, now: float) -> None:
        """Account for a batch answered (or lost) by the worker; an idle worker is free from `now`."""
        slot = self._workers.get(worker_id)
        if slot is not None:
            slot.last_progress = now
            slot.in_flight_batches -= 1
            slot.in_flight_rows -= rows
            if not slot.in_flight_batches:
                slot.busy_until = now
