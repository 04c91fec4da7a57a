"""The dispatcher: lanes + batcher + scheduler + queue bounds, driven by events and `poll(now)`.

The shell calls `submit`, `cancel`, `complete` and the worker_* methods as events happen, then `poll(now)`,
carries out the returned Decision (send the dispatches, fail the rejected requests) and sleeps until
`wake_at` or the next event. The simulator does the same under virtual time.

Invariants:
- a request is in exactly one of: queued (in a lane), dispatched (in a batch in `in_flight`), or handed back
  to the shell (in a Decision, an eviction list, or returned by `cancel`/`complete`/`worker_left`);
- a request is never dispatched after its latest start time (it could not meet its deadline): `poll`
  removes such requests before it cuts — UNAVAILABLE with the drain time as hint while the deadline is
  still ahead (a retry with a fresh deadline may succeed), DEADLINE_EXCEEDED once it has passed;
- a batch never exceeds its lane's `max_batch_size` rows and goes only to a worker with a free slot;
- with bounds, no lane holds more than `lane_max_queued` requests and all lanes together no more than
  `max_queued_bytes`: a newcomer that outranks queued work evicts the least important request, otherwise
  the newcomer is refused (UNAVAILABLE, with the time the queue needs to drain as the retry hint).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from common.errors import DeadlineExceeded, Internal, SluiceError, Unavailable
from router.policy.batcher import AdaptiveBatcher, BatchContext, Batcher, Cut
from router.policy.breaker import CircuitBreaker
from router.policy.estimators import ServiceEstimates
from router.policy.lane_stats import LaneStats
from router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest
from router.policy.scheduler import Chooser, ExpectedCompletion, Job, WorkerPool

# Retry hint for requests that find no worker serving their model: workers register within seconds.
NO_WORKER_RETRY_S = 1.0
MIN_RETRY_S = 0.01
DEFAULT_HANG_AFTER_S = 5.0
HANG_FACTOR = 10.0
"""A worker is hung once it holds work this many times longer than that work was expected to take (and
at least `hang_after_s`): slow devices and noisy estimates stay far below it."""


@dataclass(frozen=True)
class QueueBounds:
    """Limits on queued work."""

    lane_max_queued: int
    max_queued_bytes: int


@dataclass(frozen=True)
class Dispatch:
    """A batch cut from a lane and assigned to a worker."""

    batch_id: int
    worker_id: str
    lane: LaneKey
    requests: tuple[QueuedRequest, ...]
    reason: str
    expected_s: float = 0.0
    """Estimated execution time on its worker when it was sent."""

    @property
    def rows(self) -> int:
        """Batch-dimension rows in the batch."""
        return sum(r.rows for r in self.requests)


@dataclass
class Decision:
    """What the shell must do now, and when to call `poll` again at the latest."""

    dispatches: list[Dispatch] = field(default_factory=list)
    rejected: list[tuple[QueuedRequest, SluiceError]] = field(default_factory=list)
    overdue: list[tuple[QueuedRequest, str]] = field(default_factory=list)
    """Dispatched requests whose deadline passed before their worker answered, with that worker: the
    shell ends them DEADLINE_EXCEEDED now and tells the worker to drop them."""
    hung: list[str] = field(default_factory=list)
    """Workers that hold batches and made no progress for too long: the shell treats them as lost."""
    wake_at: float | None = None


Rejections = list[tuple[QueuedRequest, SluiceError]]


class Dispatcher:
    """Owns the queued and in-flight requests of one router."""

    def __init__(
        self,
        batcher: Batcher | None = None,
        chooser: Chooser | None = None,
        *,
        estimates: ServiceEstimates | None = None,
        bounds: QueueBounds | None = None,
        aging_s: float = math.inf,
        hang_after_s: float = DEFAULT_HANG_AFTER_S,
    ) -> None:
        self.batcher = batcher or AdaptiveBatcher()
        self.chooser = chooser or ExpectedCompletion()
        self.estimates = estimates or ServiceEstimates()
        self.bounds = bounds
        self.aging_s = aging_s
        self.workers = WorkerPool()
        self.breaker = CircuitBreaker()
        self.lanes: dict[LaneKey, Lane] = {}
        self.stats: dict[LaneKey, LaneStats] = {}
        self.in_flight: dict[int, Dispatch] = {}
        self.queued_bytes = 0
        self.hang_after_s = hang_after_s
        self._where: dict[int, LaneKey] = {}
        self._latest: list[tuple[float, int]] = []
        self._overdue: list[tuple[float, int]] = []
        """(earliest deadline not yet passed, batch id) of dispatched batches, soonest first."""
        self._batch_ids = itertools.count(1)

    # -- events -------------------------------------------------------------------------------------------
    def submit(self, request: QueuedRequest, limits: LaneLimits) -> Rejections:
        """Queue an admitted request, evicting less important work if a bound requires it.

        Returns the evicted requests (each with its UNAVAILABLE error); raises UNAVAILABLE when the
        request does not fit and outranks nothing. From now on the dispatcher owns the request.
        """
        lane = self.lanes.get(request.lane)
        if lane is None:
            lane = self.lanes[request.lane] = Lane(request.lane, limits, self.aging_s)
        victims = self._make_room(lane, request) if self.bounds else []
        evicted: Rejections = []
        for victim in victims:
            self.cancel(victim.request_id)
            hint = self.drain_seconds(victim.lane)
            evicted.append((victim, Unavailable("shed to make room for higher-priority work", reason="shed",
                                                retry_after_s=hint)))  # fmt: skip
        lane.push(request)
        self.stats.setdefault(request.lane, LaneStats()).arrived(request.arrival, request.rows)
        self.queued_bytes += request.size_bytes
        self._where[request.request_id] = request.lane
        heapq.heappush(self._latest, (request.latest_start, request.request_id))
        return evicted

    def _make_room(self, lane: Lane, request: QueuedRequest) -> list[QueuedRequest]:
        assert self.bounds is not None
        victims: list[QueuedRequest] = []
        if len(lane) >= self.bounds.lane_max_queued:
            victim = lane.victim(request.priority)
            if victim is None:
                raise self._full(request, f"lane {lane.key} holds {len(lane)} requests (its limit)")
            victims.append(victim)
        excess = self.queued_bytes - sum(v.size_bytes for v in victims) + request.size_bytes
        excess -= self.bounds.max_queued_bytes
        if excess > 0:
            chosen = {v.request_id for v in victims}
            candidates = sorted(
                (r for other in self.lanes.values() for r in other if r.priority > request.priority),
                key=lambda r: (-r.priority, -r.arrival),
            )
            for candidate in candidates:
                if excess <= 0:
                    break
                if candidate.request_id not in chosen:
                    victims.append(candidate)
                    excess -= candidate.size_bytes
            if excess > 0:
                raise self._full(request, f"queued inputs would exceed {self.bounds.max_queued_bytes} bytes")
        return victims

    def _full(self, request: QueuedRequest, why: str) -> Unavailable:
        return Unavailable(
            f"queue full: {why}", reason="queue_full", retry_after_s=self.drain_seconds(request.lane)
        )

    def cancel(self, request_id: int) -> QueuedRequest | None:
        """Remove a queued request (client went away, evicted); None if it is not queued."""
        key = self._where.pop(request_id, None)
        if key is None:
            return None
        request = self.lanes[key].remove(request_id)
        if request is not None:
            self.queued_bytes -= request.size_bytes
        return request

    def complete(self, batch_id: int, now: float) -> Dispatch | None:
        """A worker answered a batch: free its slot, re-estimate when the worker will be free (what it
        still holds, from now: an estimate that ran late must not linger), and hand the batch back."""
        dispatch = self.in_flight.pop(batch_id, None)
        if dispatch is not None:
            self.workers.release(dispatch.worker_id, dispatch.rows, now)
            slot = self.workers.get(dispatch.worker_id)
            if slot is not None:
                pending = [d.expected_s for d in self.in_flight.values() if d.worker_id == dispatch.worker_id]
                slot.busy_until = now + sum(pending)
        return dispatch

    def finished(self, request: QueuedRequest, now: float) -> None:
        """A request completed: feed how much of its budget it used to its lane's batching control."""
        budget = request.deadline - request.arrival
        if budget > 0:
            self.stats.setdefault(request.lane, LaneStats()).finished((now - request.arrival) / budget)

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
        self.estimates.forget_worker(worker_id)
        return lost

    def resubmit(self, request: QueuedRequest, limits: LaneLimits) -> Rejections:
        """Queue again a request whose worker was lost before answering (bounds still apply)."""
        request.attempts += 1
        return self.submit(request, limits)

    # -- decisions ----------------------------------------------------------------------------------------
    def poll(self, now: float) -> Decision:
        """Expire, then cut every batch that should leave now; say when to look again."""
        decision = Decision(rejected=self._expire(now))
        self._overdue_in_flight(now, decision)
        self._hung_workers(now, decision)
        urgency = sorted(self.lanes.values(), key=lambda ln: (ln.earliest_latest_start() or now, ln.key))
        for lane in urgency:
            try:
                self._drain_lane(lane, now, decision)
            except Exception as exc:  # a bug in one lane's decision fails that lane, not the router
                decision.rejected.extend(self._fail_lane(lane, exc))
        for key in [k for k, lane in self.lanes.items() if not len(lane)]:
            del self.lanes[key]
        decision.wake_at = _earliest(decision.wake_at, self._next_latest_start())
        return decision

    def _fail_lane(self, lane: Lane, exc: Exception) -> Rejections:
        error = Internal(
            f"the router failed to schedule this request ({type(exc).__name__})", reason="internal"
        )
        error.__cause__ = exc
        failed: Rejections = []
        for request in list(lane):
            self.cancel(request.request_id)
            failed.append((request, error))
        return failed

    def _overdue_in_flight(self, now: float, decision: Decision) -> None:
        """Dispatched requests past their deadline end now, whether or not their worker ever answers.
        One heap entry per batch, at the earliest deadline among its requests not yet overdue."""
        while self._overdue and (self._overdue[0][0] <= now or self._overdue[0][1] not in self.in_flight):
            _, batch_id = heapq.heappop(self._overdue)
            dispatch = self.in_flight.get(batch_id)
            if dispatch is None:
                continue  # answered (or lost) already
            later = [r.deadline for r in dispatch.requests if r.deadline > now]
            decision.overdue.extend(
                (r, dispatch.worker_id) for r in dispatch.requests if r.deadline <= now and not r.overdue
            )
            for request in dispatch.requests:
                request.overdue = request.overdue or request.deadline <= now
            if later:
                heapq.heappush(self._overdue, (min(later), batch_id))
        if self._overdue:
            decision.wake_at = _earliest(decision.wake_at, self._overdue[0][0])

    def _hung_workers(self, now: float, decision: Decision) -> None:
        """A worker holding batches that answered none of them for `hang_after_s` — or ten times what they
        were expected to take, if longer — is hung (a forward pass that never returns): lost."""
        for slot in self.workers:
            if not slot.in_flight_batches:
                continue
            held = sum(d.expected_s for d in self.in_flight.values() if d.worker_id == slot.worker_id)
            stalled_at = slot.last_progress + max(self.hang_after_s, HANG_FACTOR * held)
            if now >= stalled_at:
                decision.hung.append(slot.worker_id)
            else:
                decision.wake_at = _earliest(decision.wake_at, stalled_at)

    def _drain_lane(self, lane: Lane, now: float, decision: Decision) -> None:
        key = lane.key
        stats = self.stats.setdefault(key, LaneStats())

        def batch_seconds(rows: int) -> float:
            return self.estimates.batch_seconds(key.model, key.version, rows, shape=key.shape)

        def seconds_on(worker_id: str) -> float:
            rows = min(lane.rows, lane.limits.max_batch_size)
            return self.estimates.batch_seconds(key.model, key.version, rows, worker_id, key.shape)

        while len(lane):
            serving = self.workers.serving(key.model, key.version)
            if not serving:
                decision.rejected.extend(self._reject_lane(lane))
                return
            candidates = [w for w in serving if self.breaker.allows(w.worker_id, now)]
            if not candidates:  # every worker's breaker is open: look again when the first half-opens
                reopen = min(self.breaker.reopens_at(w.worker_id) or now for w in serving)
                decision.wake_at = _earliest(decision.wake_at, reopen)
                return
            job = Job(min(lane.rows, lane.limits.max_batch_size), now, seconds_on)
            worker = self.chooser.choose(candidates, job)
            if worker is None:
                return  # every candidate is full; a completion will wake the shell
            ctx = BatchContext(
                now, worker.in_flight_batches == 0, batch_seconds, len(candidates), stats, worker.busy_until
            )
            verdict = self.batcher.decide(lane, ctx)
            if not isinstance(verdict, Cut):
                decision.wake_at = _earliest(decision.wake_at, verdict.when)
                return
            requests = tuple(lane.pop_batch(now))
            for request in requests:
                self._where.pop(request.request_id, None)
                self.queued_bytes -= request.size_bytes
            rows = sum(r.rows for r in requests)
            expected = self.estimates.batch_seconds(key.model, key.version, rows, worker.worker_id, key.shape)
            dispatch = Dispatch(
                next(self._batch_ids), worker.worker_id, key, requests, verdict.reason, expected
            )
            self.workers.reserve(worker.worker_id, dispatch.rows, now, expected)
            self.breaker.dispatched(worker.worker_id, now)
            self.in_flight[dispatch.batch_id] = dispatch
            heapq.heappush(self._overdue, (min(r.deadline for r in requests), dispatch.batch_id))
            decision.dispatches.append(dispatch)

    def _reject_lane(self, lane: Lane) -> Rejections:
        key = lane.key
        rejected: Rejections = []
        for request in list(lane):
            self.cancel(request.request_id)
            error = Unavailable(
                f"no ready worker serves {key.model} version {key.version}",
                reason="no_worker",
                retry_after_s=NO_WORKER_RETRY_S,
            )
            rejected.append((request, error))
        return rejected

    def _expire(self, now: float) -> Rejections:
        expired: Rejections = []
        while self._latest and self._latest[0][0] <= now:
            _, request_id = heapq.heappop(self._latest)
            request = self.cancel(request_id)
            if request is None:
                continue
            error: SluiceError
            if now >= request.deadline:
                error = DeadlineExceeded("deadline passed while queued", reason="expired_in_queue")
            else:
                error = Unavailable(
                    f"shed before its deadline: {(request.deadline - now) * 1000:.1f} ms left is less than "
                    "the estimated time to run it",
                    reason="deadline_unmeetable",
                    retry_after_s=self.drain_seconds(request.lane),
                )
            expired.append((request, error))
        return expired

    def _next_latest_start(self) -> float | None:
        while self._latest and self._latest[0][1] not in self._where:
            heapq.heappop(self._latest)
        return self._latest[0][0] if self._latest else None

    # -- estimates and views ------------------------------------------------------------------------------
    def drain_seconds(self, key: LaneKey, rows: int | None = None) -> float:
        """Estimated time for the workers serving `key` to work through `rows` (default: the whole lane)."""
        lane = self.lanes.get(key)
        if rows is None:
            rows = lane.rows if lane is not None else 0
        batch = lane.limits.max_batch_size if lane is not None else 1
        workers = max(1, len(self.workers.serving(key.model, key.version)))
        batches = math.ceil(rows / batch)
        seconds = (
            batches * self.estimates.batch_seconds(key.model, key.version, batch, shape=key.shape) / workers
        )
        return max(MIN_RETRY_S, seconds)

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
