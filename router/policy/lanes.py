"""Lanes: queues of requests that may share a batch.

A lane is keyed by (model, resolved version, shape signature); for now the signature is the exact shape of
every input without its leading batch dimension, so any two requests in a lane can be concatenated along
dim 0. Invariants:
- after `Lane.push`, the lane owns the request until `pop_batch`, `remove` or `expire` hands it back;
- a request is in at most one lane, and never both queued and dispatched;
- `rows` counts batch-dimension rows, the unit `max_batch_size` limits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class LaneKey:
    """What makes requests batch-compatible."""

    model: str
    version: str
    shape: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __str__(self) -> str:
        dims = ",".join(f"{name}{list(dims)}" for name, dims in self.shape)
        return f"{self.model}:{self.version}[{dims}]"


@dataclass(frozen=True)
class LaneLimits:
    """Batching limits of a lane, from the model's registration."""

    max_batch_size: int
    max_wait_s: float


@dataclass(eq=False)
class QueuedRequest:
    """One admitted request as the core sees it; `payload` belongs to the shell and is never inspected."""

    request_id: int
    lane: LaneKey
    rows: int
    arrival: float
    deadline: float
    payload: object = field(default=None, repr=False)


class Lane:
    """FIFO of requests of one LaneKey (priority ordering arrives with admission control)."""

    def __init__(self, key: LaneKey, limits: LaneLimits) -> None:
        self.key = key
        self.limits = limits
        self._queue: OrderedDict[int, QueuedRequest] = OrderedDict()
        self.rows = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._queue.values())

    def push(self, request: QueuedRequest) -> None:
        """Append; the lane owns the request from now on."""
        self._queue[request.request_id] = request
        self.rows += request.rows

    def remove(self, request_id: int) -> QueuedRequest | None:
        """Take a request out (cancellation); None if it is not queued here."""
        request = self._queue.pop(request_id, None)
        if request is not None:
            self.rows -= request.rows
        return request

    def oldest_arrival(self) -> float | None:
        """Arrival time of the head of the queue."""
        head = next(iter(self._queue.values()), None)
        return None if head is None else head.arrival

    def earliest_deadline(self) -> float | None:
        """The soonest deadline among queued requests."""
        return min((r.deadline for r in self._queue.values()), default=None)

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every request whose deadline is not after `now`."""
        gone = [r for r in self._queue.values() if r.deadline <= now]
        for request in gone:
            self.remove(request.request_id)
        return gone

    def pop_batch(self) -> list[QueuedRequest]:
        """Take requests from the head while their rows fit `max_batch_size` (at least one)."""
        batch: list[QueuedRequest] = []
        rows = 0
        for request in list(self._queue.values()):
            if batch and rows + request.rows > self.limits.max_batch_size:
                break
            batch.append(request)
            rows += request.rows
        for request in batch:
            self.remove(request.request_id)
        return batch
