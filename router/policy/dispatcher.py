"""The dispatcher: lanes + batcher + scheduler, driven by events and `poll(now)`.

The shell calls `submit`, `cancel`, `complete` and the worker_* methods as events happen, then `poll(now)`,
carries out the returned Decision (send the dispatches, fail the rejected requests) and sleeps until
`wake_at` or the next event. The simulator does the same under virtual time.

Invariants:
- a request is in exactly one of: queued (in a lane), dispatched (in a batch in `in_flight`), or handed back
  to the shell (in a Decision, or returned by `cancel`/`complete`/`worker_left`);
- a request whose deadline has passed is never dispatched: `poll` expires before it cuts;
- a batch never exceeds its lane's `max_batch_size` rows and goes only to a worker with a free slot.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from common.errors import DeadlineExceeded, SluiceError, Unavailable
from router.policy.batcher import Cut, TimerBatcher
from router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest
from router.policy.scheduler import LeastLoaded, WorkerPool

# Retry hint for requests that find no worker serving their model: workers register within seconds.
NO_WORKER_RETRY_S = 1.0


@dataclass(frozen=True)
class Dispatch:
    """A batch cut from a lane and assigned to a worker."""

    batch_id: int
    worker_id: str
    lane: LaneKey
    requests: tuple[QueuedRequest, ...]
    reason: str

    @property
    def rows(self) -> int:
        """Batch-dimension rows in the batch."""
        return sum(r.rows for r in self.requests)


@dataclass
class Decision:
    """What the shell must do now, and when to call `poll` again at the latest."""

    dispatches: list[Dispatch] = field(default_factory=list)
    rejected: list[tuple[QueuedRequest, SluiceError]] = field(default_factory=list)
    wake_at: float | None = None


class Dispatcher:
    """Owns the queued and in-flight requests of one router."""

    def __init__(self, batcher: TimerBatcher | None = None, chooser: LeastLoaded | None = None) -> None:
        self.batcher = batcher or TimerBatcher()
        self.chooser = chooser or LeastLoaded()
        self.workers = WorkerPool()
        self.lanes: dict[LaneKey, Lane] = {}
        self.in_flight: dict[int, Dispatch] = {}
        self._where: dict[int, LaneKey] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._batch_ids = itertools.count(1)

    # -- events -------------------------------------------------------------------------------------------
    def submit(self, request: QueuedRequest, limits: LaneLimits) -> None:
        """Queue an admitted request; from now on the dispatcher owns it."""
        lane = self.lanes.get(request.lane)
        if lane is None:
            lane = self.lanes[request.lane] = Lane(request.lane, limits)
        lane.push(request)
        self._where[request.request_id] = request.lane
        heapq.heappush(self._deadlines, (request.deadline, request.request_id))

    def cancel(self, request_id: int) -> QueuedRequest | None:
        """Remove a queued request (client went away); None if it is not queued."""
        key = self._where.pop(request_id, None)
        if key is None:
            return None
        return self.lanes[key].remove(request_id)

    def complete(self, batch_id: int) -> Dispatch | None:
        """A worker answered a batch: free its slot and hand the batch back."""
        dispatch = self.in_flight.pop(batch_id, None)
        if dispatch is not None:
            self.workers.release(dispatch.worker_id, dispatch.rows)
        return dispatch

    def worker_joined(self, worker_id: str, models: set[tuple[str, str]], capacity: int) -> None:
        """A worker registered (or changed its models or capacity)."""
        self.workers.add(worker_id, models, capacity)

    def worker_accepting(self, worker_id: str, accepting: bool) -> None:
        """A worker's stream came up (True), or it started draining or its stream broke (False)."""
        self.workers.set_accepting(worker_id, accepting)

    def worker_left(self, worker_id: str) -> list[Dispatch]:
        """A worker is gone; its in-flight batches are handed back for the shell to settle."""
        lost = [d for d in self.in_flight.values() if d.worker_id == worker_id]
        for dispatch in lost:
            del self.in_flight[dispatch.batch_id]
        self.workers.remove(worker_id)
        return lost

    # -- decisions ----------------------------------------------------------------------------------------
    def poll(self, now: float) -> Decision:
        """Expire, then cut every batch that should leave now; say when to look again."""
        decision = Decision(rejected=self._expire(now))
        for lane in sorted(self.lanes.values(), key=lambda ln: ln.oldest_arrival() or now):
            self._drain_lane(lane, now, decision)
        for key in [k for k, lane in self.lanes.items() if not len(lane)]:
            del self.lanes[key]
        decision.wake_at = _earliest(decision.wake_at, self._next_deadline())
        return decision

    def _drain_lane(self, lane: Lane, now: float, decision: Decision) -> None:
        key = lane.key
        while len(lane):
            candidates = self.workers.serving(key.model, key.version)
            if not candidates:
                decision.rejected.extend(self._reject_lane(lane))
                return
            worker = self.chooser.choose(candidates)
            if worker is None:
                return  # every candidate is full; a completion will wake the shell
            verdict = self.batcher.decide(lane, now, worker_idle=worker.in_flight_batches == 0)
            if not isinstance(verdict, Cut):
                decision.wake_at = _earliest(decision.wake_at, verdict.when)
                return
            requests = tuple(lane.pop_batch())
            for request in requests:
                self._where.pop(request.request_id, None)
            dispatch = Dispatch(next(self._batch_ids), worker.worker_id, key, requests, verdict.reason)
            self.workers.reserve(worker.worker_id, dispatch.rows)
            self.in_flight[dispatch.batch_id] = dispatch
            decision.dispatches.append(dispatch)

    def _reject_lane(self, lane: Lane) -> list[tuple[QueuedRequest, SluiceError]]:
        key = lane.key
        rejected: list[tuple[QueuedRequest, SluiceError]] = []
        for request in list(lane):
            lane.remove(request.request_id)
            self._where.pop(request.request_id, None)
            error = Unavailable(
                f"no ready worker serves {key.model} version {key.version}",
                reason="no_worker",
                retry_after_s=NO_WORKER_RETRY_S,
            )
            rejected.append((request, error))
        return rejected

    def _expire(self, now: float) -> list[tuple[QueuedRequest, SluiceError]]:
        expired: list[tuple[QueuedRequest, SluiceError]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            request = self.cancel(request_id)
            if request is not None:
                expired.append(
                    (request, DeadlineExceeded("deadline passed while queued", reason="expired_in_queue"))
                )
        return expired

    def _next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._where:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    # -- views --------------------------------------------------------------------------------------------
    def queued(self) -> int:
        """Requests waiting in lanes."""
        return len(self._where)

    def serves(self, model: str, version: str) -> bool:
        """Whether some accepting worker has this model version."""
        return bool(self.workers.serving(model, version))


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)
