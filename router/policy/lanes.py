"""Lanes: bounded queues of requests that may share a batch, ordered by priority, fair share, deadline.

A lane is keyed by (model, resolved version, shape signature); the signature is the shape of every input
without its leading batch dimension, variable dims padded to their bucket (common/buckets.py), so any two
requests in a lane can be concatenated along dim 0. Per-shape state is bounded by router/policy/shapes.py.

Order in which a lane hands out requests (`pop_next`):
1. priority level (1 is the highest), with **aging**: a level competes as if it were one level higher for
   every `aging_s` its oldest request has waited; equal standing goes to the genuinely higher level. So a
   request of priority p outranks any newly arrived request after waiting at most p * aging_s: low
   priorities are delayed under load, never starved.
2. within a level, **start-time fair queueing** across tenants: a tenant's next request gets the start tag
   max(V, the tenant's last finish tag) and costs rows / weight; the smallest start tag goes first and V
   becomes it. Backlogged tenants are served in proportion to their weights; an idle tenant earns no credit.
3. within a tenant, **earliest deadline** first.

Invariants:
- after `push`, the lane owns the request until `pop_next`, `pop_batch` or `remove` hands it back;
- a request is in at most one lane, and never both queued and dispatched;
- `rows` and `bytes` always equal the sums over queued requests.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Final, NamedTuple, TypeAlias

from sluice_inference.common.batching import BatchFill, BatchLimits
from sluice_inference.common.records import ModelRecord

ShellData: TypeAlias = object
"""What the shell attaches to a request or an answer (a call's payload, its output tensors): carried, never
looked at by the core. Named, not written `object`, because mypyc's dataclasses look an annotation's class up
among the module's globals, where a bare builtin is not (common/compiled_core.py)."""


class LaneKey(NamedTuple):
    """What makes requests batch-compatible. A tuple, so hashing it (a dictionary lookup or two per request)
    runs in C."""

    model: str
    version: str
    shape: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __str__(self) -> str:
        dims = ",".join(f"{name}{list(dims)}" for name, dims in self.shape)
        return f"{self.model}:{self.version}[{dims}]"


MAX_REMEMBERED_LIMITS: Final = 1024
"""Distinct limits `LaneLimits.of` remembers (registered model versions have a handful), least recently
used first out."""


@dataclass(frozen=True)
class LaneLimits:
    """Batching limits of a lane, from the model's registration."""

    max_batch_size: int
    max_wait_s: float
    max_batch_cost: int | None = None
    """Cap on a batch's summed request costs (padded elements, e.g. tokens), besides the row count."""
    max_batch_bytes: int | None = None
    """Cap on a batch's summed request `wire_bytes`, so a batch and its result fit one message to and from
    the worker (the cluster's message limit)."""
    batch: BatchLimits = field(init=False, repr=False, compare=False)
    """These limits as the batching rule takes them (common/batching.py), asked per batch: built once."""

    @classmethod
    def of(cls, record: ModelRecord) -> LaneLimits:
        """A model version's limits as its registration states them (a pure function of the record, so
        the shell builds them with the request; the core adds its message cap in `new_request`). Asked
        per request: records with the same limits share one object, so a changed record gets new ones."""
        return _shared_limits(record.max_batch_size, record.max_wait_s, record.max_batch_cost)

    def __post_init__(self) -> None:
        # Set once here, as a frozen object allows; not a cached_property, which mypyc compiles to a plain
        # property built again at every read.
        object.__setattr__(
            self, "batch", BatchLimits(self.max_batch_size, self.max_batch_cost, self.max_batch_bytes)
        )


@lru_cache(maxsize=MAX_REMEMBERED_LIMITS)
def _shared_limits(max_batch_size: int, max_wait_s: float, max_batch_cost: int | None) -> LaneLimits:
    """One frozen `LaneLimits` per distinct set of values, not one per request (`LaneLimits.of`)."""
    return LaneLimits(max_batch_size, max_wait_s, max_batch_cost)


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """One admitted request as the core sees it; `payload` belongs to the shell and is never inspected."""

    request_id: int
    lane: LaneKey
    rows: int
    arrival: float
    deadline: float
    payload: ShellData = field(default=None, repr=False)
    limits: LaneLimits | None = None
    """Its lane's batching limits, as its model version was registered when it came in: they ride with
    the request, so the core learns them at `arrive` with no question back to the shell (None only for a
    request that never arrives, as in the lane and ledger tests)."""
    tenant: str = ""
    priority: int = 1
    weight: float = 1.0
    size_bytes: int = 0
    cost: int = 1
    """Rows times the padded variable-dim length: what `max_batch_cost` counts."""
    wire_bytes: int = 0
    """Its inputs plus its expected outputs on the worker stream: what `max_batch_bytes` counts."""
    attempts: int = 1
    """Dispatches so far; a request whose worker died is re-dispatched at most once."""
    latest_start: float = math.inf
    """The last moment its batch may start and still finish by the deadline: never past the deadline, at
    which `RouterCore.new_request` starts it; admission brings it forward. (Not checked here: a
    `__post_init__` would be a call per request.)"""
    admitted: bool = False
    """It holds an admission slot (in-flight quota) until it ends."""
    ended: bool = False
    """It has been settled (result, error, or the client went away): later news about it is ignored."""

    def __init__(  # noqa: PLR0917 (positional, as the dataclass's own `__init__` takes them)
        self,
        request_id: int,
        lane: LaneKey,
        rows: int,
        arrival: float,
        deadline: float,
        payload: ShellData = None,
        limits: LaneLimits | None = None,
        tenant: str = "",
        priority: int = 1,
        weight: float = 1.0,
        size_bytes: int = 0,
        cost: int = 1,
        wire_bytes: int = 0,
        attempts: int = 1,
        latest_start: float = math.inf,
        admitted: bool = False,
        ended: bool = False,
    ) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.request_id = request_id
        self.lane = lane
        self.rows = rows
        self.arrival = arrival
        self.deadline = deadline
        self.payload = payload
        self.limits = limits
        self.tenant = tenant
        self.priority = priority
        self.weight = weight
        self.size_bytes = size_bytes
        self.cost = cost
        self.wire_bytes = wire_bytes
        self.attempts = attempts
        self.latest_start = latest_start
        self.admitted = admitted
        self.ended = ended


@dataclass(slots=True)
class _TenantQueue:
    heap: list[tuple[float, int, QueuedRequest]] = field(default_factory=list)
    finish: float = 0.0
    live: int = 0


@dataclass(slots=True)
class _Level:
    tenants: dict[str, _TenantQueue] = field(default_factory=dict)
    arrivals: OrderedDict[int, QueuedRequest] = field(default_factory=OrderedDict)
    virtual: float = 0.0
    rows: int = 0


class Lane:
    """The queue of one LaneKey."""

    def __init__(self, key: LaneKey, limits: LaneLimits, aging_s: float = math.inf) -> None:
        self.key = key
        self.limits = limits
        self.aging_s = aging_s
        self.rows = 0
        self.bytes = 0
        self._levels: dict[int, _Level] = {}
        self._arrivals: OrderedDict[int, QueuedRequest] = OrderedDict()
        """Every queued request by id, oldest first (the one record of what the lane holds: its levels'
        `arrivals` split it by priority)."""
        self._latest: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._arrivals)

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(list(self._arrivals.values()))

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._arrivals

    def push(self, request: QueuedRequest) -> None:
        """Queue a request; the lane owns it from now on."""
        level = self._levels.get(request.priority)
        if level is None:
            level = self._levels[request.priority] = _Level()
        queue = level.tenants.get(request.tenant)
        if queue is None:
            queue = level.tenants[request.tenant] = _TenantQueue()
        heapq.heappush(queue.heap, (request.deadline, request.request_id, request))
        queue.live += 1
        level.arrivals[request.request_id] = request
        level.rows += request.rows
        self._arrivals[request.request_id] = request
        heapq.heappush(self._latest, (request.latest_start, request.request_id))
        self.rows += request.rows
        self.bytes += request.size_bytes

    def remove(self, request_id: int) -> QueuedRequest | None:
        """Take a request out (cancelled, expired, evicted); None if it is not queued here."""
        request = self._arrivals.pop(request_id, None)
        if request is None:
            return None
        level = self._levels[request.priority]
        level.arrivals.pop(request_id, None)
        level.rows -= request.rows
        queue = level.tenants[request.tenant]
        queue.live -= 1
        if not queue.live:
            queue.heap.clear()  # drop lazily deleted entries, so cancellations cannot pile up
        self.rows -= request.rows
        self.bytes -= request.size_bytes
        return request

    def rows_ahead_of(self, priority: int) -> int:
        """Rows queued at this priority or better: what a new request of `priority` waits behind."""
        if len(self._levels) == 1:  # the common case, without a generator
            ((only, level),) = self._levels.items()
            return level.rows if only <= priority else 0
        rows = 0
        for level_priority, level in self._levels.items():
            if level_priority <= priority:
                rows += level.rows
        return rows

    def oldest_arrival(self) -> float | None:
        """Arrival time of the request that has waited longest."""
        head = next(iter(self._arrivals.values()), None)
        return None if head is None else head.arrival

    def earliest_latest_start(self) -> float | None:
        """The soonest `latest_start` among queued requests."""
        while self._latest and self._latest[0][1] not in self._arrivals:
            heapq.heappop(self._latest)
        return self._latest[0][0] if self._latest else None

    def pop_late(self, now: float) -> list[QueuedRequest]:
        """Take out every request whose latest start has come: it can no longer make its deadline."""
        late = []
        while (soonest := self.earliest_latest_start()) is not None and soonest <= now:
            _, request_id = heapq.heappop(self._latest)
            request = self.remove(request_id)
            if request is not None:
                late.append(request)
        return late

    def _standing(self, priority: int, level: _Level, now: float) -> tuple[float, int]:
        oldest = next(iter(level.arrivals.values()))
        waited = max(0.0, now - oldest.arrival)
        aged = priority - (math.floor(waited / self.aging_s) if math.isfinite(self.aging_s) else 0)
        return (aged, priority)

    def pop_next(self, now: float) -> QueuedRequest | None:
        """Take the request that should be served next (see the module docstring), or None."""
        if len(self._levels) == 1:  # the common case: no standing to compare
            ((_, level),) = self._levels.items()
            if not level.arrivals:
                return None
        else:  # the best standing; the first of equals, in the order levels were created (as `min`)
            best: tuple[tuple[float, int], _Level] | None = None
            for priority, candidate in self._levels.items():
                if candidate.arrivals:
                    standing = self._standing(priority, candidate, now)
                    if best is None or standing < best[0]:
                        best = (standing, candidate)
            if best is None:
                return None
            level = best[1]
        tenants = level.tenants
        if len(tenants) == 1:  # one tenant, and it is live: its level holds arrivals
            ((name, queue),) = tenants.items()
            start = level.virtual if level.virtual > queue.finish else queue.finish
        else:
            start, name = min((max(level.virtual, q.finish), name) for name, q in tenants.items() if q.live)
            queue = tenants[name]
        while True:
            _, request_id, request = heapq.heappop(queue.heap)
            if request_id in self._arrivals:
                break
        queue.finish = start + request.rows / request.weight
        level.virtual = start
        self.remove(request_id)
        return request

    def pop_batch(self, now: float) -> list[QueuedRequest]:
        """Take requests in serving order while they fit the lane's limits (common/batching.py: rows,
        costs and wire bytes; always at least one)."""
        batch: list[QueuedRequest] = []
        fill = BatchFill(self.limits.batch)
        while self._arrivals:
            request = self.pop_next(now)
            assert request is not None
            if not fill.take(request.rows, request.cost, request.wire_bytes):
                self._requeue(request)
                break
            batch.append(request)
        return batch

    def _requeue(self, request: QueuedRequest) -> None:
        """Put back a request popped but not taken; its tenant's finish tag is rolled back."""
        level = self._levels[request.priority]
        queue = level.tenants[request.tenant]
        queue.finish -= request.rows / request.weight
        self.push(request)
        level.arrivals.move_to_end(request.request_id, last=False)
        self._arrivals.move_to_end(request.request_id, last=False)

    def victim(self, newcomer_priority: int) -> QueuedRequest | None:
        """The least important queued request that `newcomer_priority` outranks, or None.

        Least important: the worst priority level; in it, the tenant with the most queued requests (the
        heaviest user pays first); of that tenant, the newest request (older ones have waited longer).
        """
        worse = [p for p, level in self._levels.items() if level.arrivals and p > newcomer_priority]
        if not worse:
            return None
        level = self._levels[max(worse)]
        tenant = max(level.tenants, key=lambda name: (level.tenants[name].live, name))
        for request in reversed(level.arrivals.values()):
            if request.tenant == tenant:
                return request
        return None
