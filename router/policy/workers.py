"""The router's view of the workers: one slot each, the load every router puts on it, and an index of who
can take a batch now, per model version.

A worker **accepts** batches while its etcd record says ready, its stream is up and its latest load report
does not say otherwise (draining, starting). It **has a free place** while this router holds fewer than
`per_router` batches on it and — counting the batches the other routers hold there, from its latest load
report or answer — fewer than the worker's own `capacity` (all routers together). Without the second half
N routers could stack 2·N batches on one worker, each believing it nearly idle.

Invariants (the core relies on them; the simulator at 1,000 workers depends on their cost):
- `free(key)` holds exactly the accepting, breaker-allowed workers serving `key` with a free place, and
  `serving(key)` counts the accepting ones; both change in O(models of one worker) on every slot change,
  so choosing a worker never scans the fleet;
- `reserve`/`release` are paired once per batch by the core.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final

ModelVersion = tuple[str, str]


@dataclass(eq=False, slots=True)
class WorkerSlot:
    """What this router knows about one worker."""

    worker_id: str
    models: frozenset[ModelVersion]
    capacity: int
    """Batches the worker holds at once from all routers together (its registration)."""
    per_router: int
    """Batches this router keeps on it at most (`router.batches_in_flight_per_worker`)."""
    registered_ready: bool = True
    connected: bool = False
    reported_ready: bool = True
    allowed: bool = True
    """Its circuit breaker lets a batch through now."""
    in_flight_batches: int = 0
    in_flight_rows: int = 0
    busy_until: float = 0.0
    """When the batches this router sent it are expected to be done."""
    last_progress: float = 0.0
    """When it last answered a batch of ours, or took one while idle (hang detection)."""
    last_answer: float = -1.0
    """When it last answered a batch of ours (the learning formula measures from here)."""
    others: int = 0
    """Batches other routers held on it at its latest report."""
    others_free_at: float = 0.0
    """When those are expected to be done (this router's estimate)."""
    batch_s: float = 0.0
    """A typical batch's time on it, as this router measured (what another router's batch is assumed to
    take there)."""
    batches: dict[int, float] = field(default_factory=dict)
    """This router's batches on it: batch id → expected seconds."""
    indexed: tuple[bool, bool] | None = None
    """(accepting, has a free slot) as the pool's indexes hold it; None while in none."""

    @property
    def held_s(self) -> float:
        """Expected seconds of the batches this router holds on it."""
        return sum(self.batches.values())

    @property
    def accepting(self) -> bool:
        """Whether it takes new batches at all (registered ready, connected, not draining)."""
        return self.state()[0]

    @property
    def has_free_slot(self) -> bool:
        """Whether one more batch of ours may go to it now."""
        return self.state()[1]

    def state(self) -> tuple[bool, bool]:
        """(`accepting`, `has_free_slot`), the rules of both, in one call: the pool asks both on every
        slot change."""
        accepting = self.registered_ready and self.connected and self.reported_ready
        in_flight = self.in_flight_batches
        return accepting, (
            accepting
            and self.allowed
            and in_flight < self.per_router
            and in_flight + self.others < self.capacity
        )


class IndexedSet:
    """Workers with O(1) add, remove and random sampling (a list plus positions)."""

    def __init__(self) -> None:
        self._items: list[WorkerSlot] = []
        self._positions: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(self._items)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._positions

    def add(self, slot: WorkerSlot) -> None:
        """Insert (no-op if present)."""
        if slot.worker_id not in self._positions:
            self._positions[slot.worker_id] = len(self._items)
            self._items.append(slot)

    def discard(self, worker_id: str) -> None:
        """Remove (no-op if absent): the last item takes the removed one's place."""
        position = self._positions.pop(worker_id, None)
        if position is None:
            return
        last = self._items.pop()
        if position < len(self._items):
            self._items[position] = last
            self._positions[last.worker_id] = position

    def first(self) -> WorkerSlot:
        """A member (IndexError when empty): the only one, for a caller that knows there is one."""
        return self._items[0]

    def sample(self, count: int, rng: random.Random) -> list[WorkerSlot]:
        """`count` distinct members drawn uniformly (all of them when there are fewer).

        The very draws `rng.sample(items, count)` makes, by CPython's own algorithm for a small `count`
        (a pool for a small population, else redraws against the picks so far), so every decision stays
        as it was: written here because `random.sample` is interpreted Python, called once per batching
        decision, and was the compiled core's largest call back into the interpreter."""
        items = self._items
        size = len(items)
        if size <= count:
            return list(items)
        if count > _SMALL_SAMPLE:  # CPython sizes its set differently past five: leave those to it
            return rng.sample(items, count)
        if size <= _POOL_BELOW:
            pool = list(items)
            picked = []
            for i in range(count):
                j = _below(rng, size - i)
                picked.append(pool[j])
                pool[j] = pool[size - i - 1]
            return picked
        chosen: set[int] = set()
        picked = []
        for _ in range(count):
            j = _below(rng, size)
            while j in chosen:
                j = _below(rng, size)
            chosen.add(j)
            picked.append(items[j])
        return picked


_SMALL_SAMPLE: Final = 5
_POOL_BELOW: Final = 21
"""CPython's `random.sample` for at most `_SMALL_SAMPLE` picks: a population of at most `_POOL_BELOW` is
drawn from a copied pool, a larger one by redrawing repeats."""


def _below(rng: random.Random, n: int) -> int:
    """A uniform integer in [0, n), exactly as `random.Random._randbelow` draws it from `getrandbits`."""
    bits = n.bit_length()
    r = rng.getrandbits(bits)
    while r >= n:
        r = rng.getrandbits(bits)
    return r


_NONE: Final = IndexedSet()
"""What `serving` and `free` return for a version no worker has (shared: never mutated). (`or` with a new
empty set asked the index's `__len__` on every call, several times per request.)"""


@dataclass
class WorkerPool:
    """Every known worker's slot, and the per-version indexes of who serves and who has room."""

    _workers: dict[str, WorkerSlot] = field(default_factory=dict)
    _free: dict[ModelVersion, IndexedSet] = field(default_factory=dict)
    _serving: dict[ModelVersion, IndexedSet] = field(default_factory=dict)
    epoch: int = 0
    """Counts slot changes: a batching decision taken at one epoch stands until the next."""

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> WorkerSlot | None:
        """The slot of a worker, if known."""
        return self._workers.get(worker_id)

    def add(
        self, worker_id: str, models: Iterable[ModelVersion], capacity: int, per_router: int
    ) -> WorkerSlot:
        """Register a worker, or refresh its models and capacity (keeping its in-flight counts)."""
        slot = self._workers.get(worker_id)
        if slot is None:
            slot = self._workers[worker_id] = WorkerSlot(worker_id, frozenset(models), capacity, per_router)
        else:
            self._unindex(slot)
            slot.models, slot.capacity, slot.per_router = frozenset(models), capacity, per_router
        self.refresh(slot)
        return slot

    def remove(self, worker_id: str) -> WorkerSlot | None:
        """Forget a worker."""
        slot = self._workers.pop(worker_id, None)
        if slot is not None:
            self._unindex(slot)
        return slot

    def refresh(self, slot: WorkerSlot) -> None:
        """Put the slot where its current state says, in every index of its models."""
        self.epoch += 1
        state = (accepting, free) = slot.state()
        if slot.indexed == state:  # most changes (a batch sent or answered) move it in no index
            return
        slot.indexed = state
        for key in slot.models:
            serving = self._serving.get(key)
            if serving is None:
                serving = self._serving[key] = IndexedSet()
            room = self._free.get(key)
            if room is None:
                room = self._free[key] = IndexedSet()
            if accepting:
                serving.add(slot)
            else:
                serving.discard(slot.worker_id)
            if free:
                room.add(slot)
            else:
                room.discard(slot.worker_id)

    def _unindex(self, slot: WorkerSlot) -> None:
        self.epoch += 1
        slot.indexed = None
        for key in slot.models:
            for index in (self._serving.get(key), self._free.get(key)):
                if index is not None:
                    index.discard(slot.worker_id)

    def serving(self, key: ModelVersion) -> IndexedSet:
        """Accepting workers that have this model version (do not mutate)."""
        index = self._serving.get(key)
        return _NONE if index is None else index

    def free(self, key: ModelVersion) -> IndexedSet:
        """Workers that can take a batch of this version now (do not mutate)."""
        index = self._free.get(key)
        return _NONE if index is None else index

    def serving_count(self, key: ModelVersion) -> int:
        """How many accepting workers have this model version (asked several times per request: one call,
        not `len` of `serving`, which is two)."""
        index = self._serving.get(key)
        return 0 if index is None else len(index._items)

    def free_count(self, key: ModelVersion) -> int:
        """How many workers can take a batch of this version now."""
        index = self._free.get(key)
        return 0 if index is None else len(index._items)

    def reserve(self, slot: WorkerSlot, batch_id: int, rows: int, now: float, seconds: float) -> None:
        """A batch of ours, expected to run `seconds`, went to the worker."""
        if not slot.in_flight_batches:
            slot.last_progress = now
        slot.batches[batch_id] = seconds
        slot.in_flight_batches += 1
        slot.in_flight_rows += rows
        slot.busy_until = max(slot.busy_until, now) + seconds
        self.refresh(slot)

    def release(self, slot: WorkerSlot, batch_id: int, rows: int, now: float) -> None:
        """A batch of ours was answered (or lost): its place frees up, and the worker is expected to be done
        with what it still holds from now on (an estimate that ran late must not linger)."""
        del slot.batches[batch_id]
        slot.last_progress = now
        slot.in_flight_batches -= 1
        slot.in_flight_rows -= rows
        slot.busy_until = now + slot.held_s
        self.refresh(slot)
