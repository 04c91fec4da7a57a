"""Dispatching: carrying out the planner's steps for a lane — cutting batches, numbering them, recording
them in flight and on their worker — and settling a batch once it is answered, lost or unsent.

Rules: a batch is in the ledger (in_flight.py) and holds a place on its worker (fleet.py) from `drain` to
`settle`, both or neither; a lane whose decision raises fails alone (its requests end INTERNAL), never the
router. It holds its sibling mechanisms, never the core.
"""

from __future__ import annotations

import itertools

from sluice_inference.common.errors import Internal
from sluice_inference.router.policy.endings import Endings, no_worker
from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.fleet import Fleet
from sluice_inference.router.policy.in_flight import InFlight
from sluice_inference.router.policy.lanes import Lane
from sluice_inference.router.policy.outcomes import Decision, Dispatch
from sluice_inference.router.policy.planner import BLOCKED, NO_WORKER, Planner, Send, Wait
from sluice_inference.router.policy.queues import Queues
from sluice_inference.router.policy.ratelimit import RateLimiter
from sluice_inference.router.policy.workers import WorkerSlot


class Dispatcher:
    """Sends what the planner says and takes batches back."""

    def __init__(
        self,
        planner: Planner,
        fleet: Fleet,
        ledger: InFlight,
        endings: Endings,
        *,
        estimates: ServiceEstimates,
        queues: Queues,
        limiter: RateLimiter,
    ) -> None:
        self._planner = planner
        self._fleet = fleet
        self._ledger = ledger
        self._endings = endings
        self._estimates = estimates
        self._queues = queues
        self._limiter = limiter
        self._batch_ids = itertools.count(1)
        self.sent_batches = 0
        """Batches cut so far (the shell fits the router's CPU per batch and per row from these)."""
        self.sent_rows = 0
        """Rows in those batches."""

    def drain(self, decision: Decision, lane: Lane, now: float) -> None:
        """Send the lane's batches until the planner says wait, every worker is blocked, or it is empty."""
        key = lane.key
        version = (key.model, key.version)
        workers = self._fleet.pool
        if workers.serving_count(version) and not workers.free_count(version):
            return  # every worker is full or breaker-blocked (what the chooser would find, at once)
        try:
            stats = self._queues.stats_of(key)
            while len(lane):
                rate = self._queues.total_arrival_rate(now) if self._planner.host.constrained else 0.0
                step = self._planner.step(
                    lane, now, workers=workers, estimates=self._estimates, stats=stats,
                    routers=self._limiter.routers, arrival_rate=rate,
                )  # fmt: skip
                if isinstance(step, Send):
                    self._send(decision, step.worker, lane, step.reason, now)
                    continue
                if isinstance(step, Wait):
                    decision.wake(step.when)
                elif step == NO_WORKER:
                    for request in list(lane):
                        lane.remove(request.request_id)
                        self._endings.end(decision, request, no_worker(key))
                else:
                    assert step == BLOCKED
                return
        except Exception as exc:  # a bug in one lane's decision fails that lane, not the router
            self._fail_lane(decision, lane, exc)

    def _send(self, decision: Decision, worker: WorkerSlot, lane: Lane, reason: str, now: float) -> None:
        key = lane.key
        requests = tuple(lane.pop_batch(now))
        rows = 0
        for request in requests:  # a loop, not a generator: one call per batch, not one per request
            rows += request.rows
        expected = self._estimates.batch_seconds(key.model, key.version, rows, worker.worker_id, key.shape)
        dispatch = Dispatch(
            next(self._batch_ids), worker.worker_id, key, requests, reason, expected, now, rows
        )
        self.sent_batches += 1
        self.sent_rows += rows
        self._ledger.add(dispatch)
        self._fleet.reserve(worker, dispatch, now)
        decision.dispatches.append(dispatch)

    def _fail_lane(self, decision: Decision, lane: Lane, exc: Exception) -> None:
        error = Internal(
            f"the router failed to schedule this request ({type(exc).__name__})", reason="internal"
        )
        error.__cause__ = exc
        for request in list(lane):
            lane.remove(request.request_id)
            self._endings.end(decision, request, error)

    def settle(self, dispatch: Dispatch, now: float) -> WorkerSlot | None:
        """A batch is no longer in flight (answered, lost or unsent): free its worker's place."""
        self._ledger.forget(dispatch)
        return self._fleet.release(dispatch, now)
