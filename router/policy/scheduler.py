"""Which worker gets a batch: the choice policies, each given only the workers that can take it now.

Policies (config `router.scheduler`): `expected_completion` (default) sends a batch to the worker that
should finish it first — when it is expected to be free of what this router and the other routers put on
it, plus t(n) on *that* worker, learned from its own answers — sampling two random candidates when more
than `SAMPLE_ABOVE` could take it (the power of two choices keeps the cost constant with thousands of
workers while staying close to the best choice); `least_loaded` (fewest batches in flight) and
`round_robin` are kept as baselines (they look at every free worker). A worker twice as slow sees its
expected completion times double, so it receives about half the work.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from sluice_inference.router.policy.workers import IndexedSet, WorkerSlot

SAMPLE_ABOVE: Final = 4


@dataclass(slots=True)
class Job:
    """The batch being placed: its size, the time, and its estimated duration on a given worker. (Not
    frozen: one is built per decision, and a frozen dataclass costs about five times as much to build.)"""

    rows: int
    now: float
    seconds_on: Callable[[str], float]


class Chooser(Protocol):
    """A worker-choice policy."""

    def choose(self, free: IndexedSet, job: Job) -> WorkerSlot | None:
        """One of `free` (workers that can take a batch now) for `job`, or None when there is none."""
        ...


class LeastLoaded:
    """Fewest batches in flight, then fewest rows, then name (deterministic ties)."""

    def choose(self, free: IndexedSet, job: Job) -> WorkerSlot | None:
        """The least-loaded free worker, or None."""
        if len(free) == 1:  # asked per batch: one candidate needs no ordering
            return free.first()
        return min(free, key=lambda w: (w.in_flight_batches, w.in_flight_rows, w.worker_id), default=None)


class RoundRobin:
    """Free workers in turn, ignoring load and speed (a baseline)."""

    def __init__(self) -> None:
        self._last = ""

    def choose(self, free: IndexedSet, job: Job) -> WorkerSlot | None:
        """The next free worker after the one chosen last, by name."""
        ordered = sorted(free, key=lambda w: w.worker_id)
        if not ordered:
            return None
        chosen = next((w for w in ordered if w.worker_id > self._last), ordered[0])
        self._last = chosen.worker_id
        return chosen


class ExpectedCompletion:
    """Earliest expected completion: max(now, free of our batches, free of other routers') + t(n) there."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random(0)

    def choose(self, free: IndexedSet, job: Job) -> WorkerSlot | None:
        """The free worker expected to finish `job` first (among two sampled when many are free)."""
        if len(free) == 1:  # asked per batch: one candidate needs no estimate
            return free.first()
        candidates = free.sample(2, self._rng) if len(free) > SAMPLE_ABOVE else list(free)

        def finish(worker: WorkerSlot) -> tuple[float, str]:
            start = max(job.now, worker.busy_until, worker.others_free_at)
            return (start + job.seconds_on(worker.worker_id), worker.worker_id)

        return min(candidates, key=finish, default=None)


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
