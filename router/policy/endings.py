"""How requests end: the one place that turns a request's fate into its outcome, releases its admission slot
and, where the rules allow, queues it again.

Rules:
- a request ends exactly once (`end`), and releases its admission slot then;
- a lost batch's requests (worker gone, stream broke, send failed) are queued once more while their latest
  start has not come, else end UNAVAILABLE `worker_lost` with a short hint; a worker that was full
  (`BUSY`) is no one's fault and does not count as an attempt;
- an answered request ends with its worker's error, DEADLINE_EXCEEDED `finished_late` after its deadline,
  or its outputs (and its lane learns how much of its budget it used);
- a queued request shed at its latest start ends as `DeadlineBudget.shed_in_queue` says; retry hints are
  the lane's drain time (backlog.py `drain_seconds`).
What counts as late is the deadline budget's (deadline_budget.py); this module only applies it.
It holds the mechanisms it needs (admission, queues, workers, estimates), never the core.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from sluice_inference.common.errors import (
    Internal,
    SluiceError,
    Unavailable,
    error_for_code,
)
from sluice_inference.router.policy.admission import AdmissionController
from sluice_inference.router.policy.backlog import MIN_RETRY_S, drain_seconds
from sluice_inference.router.policy.deadline_budget import DeadlineBudget
from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.lane_stats import LaneStats
from sluice_inference.router.policy.lanes import LaneKey, LaneLimits, QueuedRequest
from sluice_inference.router.policy.outcomes import Decision, Dispatch, ItemAnswer, Served, Settled
from sluice_inference.router.policy.queues import QueueFull, Queues
from sluice_inference.router.policy.workers import WorkerPool

NO_WORKER_RETRY_S: Final = 1.0
"""Hint for requests that find no worker serving their model: workers register within seconds."""
WORKER_LOST_RETRY_S: Final = 0.1
"""A worker vanished mid-batch: the request can be retried at once on another worker."""
BUSY: Final = "worker_busy"
"""Item reason of a worker that was full when the batch arrived: place it elsewhere, no one's fault."""


class Endings:
    """Ends requests, or queues them again, for one router."""

    def __init__(
        self, admission: AdmissionController, queues: Queues, workers: WorkerPool, estimates: ServiceEstimates
    ) -> None:
        self._admission = admission
        self._queues = queues
        self._workers = workers
        self._estimates = estimates

    def end(self, decision: Decision, request: QueuedRequest, outcome: Served | SluiceError) -> None:
        """End a request exactly once; its admission slot is released."""
        if request.ended:
            return
        request.ended = True
        self._admission.release(request)
        decision.settled.append(Settled(request, outcome))  # `Decision.settle`, without a call per request

    def refused(self, decision: Decision, request: QueuedRequest, error: SluiceError) -> None:
        """End a request with a refusal the core caught (`end`), kept without its traceback and context:
        their frames hold the decision that now holds the error, a reference cycle per refusal that only
        the cyclic collector frees (~20 objects each; under overload, most of the garbage it scans)."""
        error.__traceback__ = None
        error.__context__ = None
        self.end(decision, request, error)

    def queue(self, decision: Decision, request: QueuedRequest, limits: LaneLimits | None = None) -> None:
        """Queue a request (`limits`: its lane's, as its model version is registered now; None for one
        queued again: the lane's last); requests it evicts end UNAVAILABLE `shed`; raises UNAVAILABLE
        `queue_full` (with the lane's drain time as hint) if it does not fit."""
        try:
            victims = self._queues.push(request, limits)
        except QueueFull as full:
            hint = self.drain_seconds(request.lane)
            raise Unavailable(f"queue full: {full}", reason="queue_full", retry_after_s=hint) from None
        for victim in victims:
            shed = Unavailable(
                "shed to make room for higher-priority work",
                reason="shed",
                retry_after_s=self.drain_seconds(victim.lane),
            )
            self.end(decision, victim, shed)

    def again_or_end(
        self, decision: Decision, request: QueuedRequest, error: SluiceError, now: float, *, charge: bool
    ) -> None:
        """Queue a request again — at most once for `charge`d causes (a lost worker), and only while its
        latest start has not come — else end it with `error`."""
        if (charge and request.attempts > 1) or now >= request.latest_start:
            self.end(decision, request, error)
            return
        if charge:
            request.attempts += 1
        try:
            self.queue(decision, request)
        except SluiceError as refused:
            self.refused(decision, request, refused)

    def lost(self, decision: Decision, dispatch: Dispatch, why: str, now: float) -> None:
        """A batch will not be answered: its requests go elsewhere if they can."""
        error = Unavailable(
            f"worker {dispatch.worker_id} was lost before answering ({why})",
            reason="worker_lost",
            retry_after_s=WORKER_LOST_RETRY_S,
        )
        for request in dispatch.requests:
            if not request.ended:
                self.again_or_end(decision, request, error, now, charge=True)

    def answered(
        self,
        decision: Decision,
        dispatch: Dispatch,
        items: Mapping[int, ItemAnswer],
        now: float,
        *,
        stats: LaneStats,
    ) -> None:
        """End the requests of an answered batch that have not ended, each by its item in `items` (`stats`:
        their lane's, which learn how much of its budget each used). One call per batch: it runs per
        request."""
        for request in dispatch.requests:
            if request.ended:
                continue
            item = items.get(request.request_id)
            if item is None:
                missing = Internal(f"worker {dispatch.worker_id} returned no outcome for this request")
                self.end(decision, request, missing)
            elif item.code and item.reason == BUSY:
                busy = Unavailable(item.message, reason=BUSY, retry_after_s=MIN_RETRY_S)
                self.again_or_end(decision, request, busy, now, charge=False)
            elif item.code:
                self.end(decision, request, error_for_code(item.code, item.message, reason="worker_error"))
            elif (late := DeadlineBudget.finished_late(request.deadline, now)) is not None:
                self.end(decision, request, late)
            else:
                budget = request.deadline - request.arrival
                if budget > 0:
                    stats.finished((now - request.arrival) / budget)
                queue_s = dispatch.sent_at - request.arrival
                self.end(decision, request, Served(dispatch.worker_id, dispatch.rows, queue_s, item.outputs))

    def late(self, request: QueuedRequest, now: float) -> SluiceError:
        """The error of a queued request shed at its latest start."""
        return DeadlineBudget.shed_in_queue(request.deadline, now, self.drain_seconds(request.lane))

    def drain_seconds(self, key: LaneKey, rows: int | None = None) -> float:
        """Estimated time for the workers serving `key` to work through `rows` (default: the whole lane)."""
        lane = self._queues.lanes.get(key)
        if rows is None:
            rows = lane.rows if lane is not None else 0
        batch = lane.limits.max_batch_size if lane is not None else 1
        workers = max(1, self._workers.serving_count((key.model, key.version)))
        return drain_seconds(self._estimates, key, rows, batch, workers)


def no_worker(key: LaneKey) -> Unavailable:
    """The error of a request no accepting worker serves."""
    return Unavailable(
        f"no ready worker serves {key.model} version {key.version}",
        reason="no_worker",
        retry_after_s=NO_WORKER_RETRY_S,
    )
