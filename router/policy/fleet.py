"""The fleet: what one router knows of each worker and does to it — its slot (workers.py), its health
(health.py: hang timer, breaker) and what its answers teach the estimates (estimators.py).

Rules:
- a worker's slot changes only here, and every change that can alter who takes a batch refreshes the
  pool's index (and its epoch);
- a batch's time, as the router sees the worker, is from when the worker could start it (sent to an idle
  worker, or its previous answer) to its answer, or the forward time if longer; it teaches the worker's
  typical batch time and the estimates;
- a failure the worker blames on itself counts against its breaker, anything else closes it.
It returns what it learned; ending requests is the core's (endings.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.health import WorkerHealth
from sluice_inference.router.policy.outcomes import BatchAnswer, Dispatch, Learned
from sluice_inference.router.policy.workers import WorkerPool, WorkerSlot

Registered = Mapping[tuple[str, str], Mapping[int, float]]
"""A registration's model versions, each with its warm-up forward time by batch size."""
BATCH_S_WEIGHT: Final = 0.2
"""How fast a worker's typical batch time follows what this router measures there."""


def in_flight_for(device: str) -> int:
    """Batches a router keeps on a worker by default: one on a CPU, two on an accelerator
    (`router.batches_in_flight_per_worker`)."""
    return 1 if device.split(":", 1)[0] == "cpu" else 2


class Fleet:
    """The workers of one router: slots, health and the estimates their answers feed."""

    def __init__(self, estimates: ServiceEstimates, hang_after_s: float, per_router: int) -> None:
        self.pool = WorkerPool()
        self.health = WorkerHealth(hang_after_s)
        self._estimates = estimates
        self._per_router = per_router

    def registered(
        self,
        worker_id: str,
        models: Mapping[tuple[str, str], Mapping[int, float]],
        capacity: int,
        ready: bool,
        device: str,
    ) -> None:
        """A registration appeared or changed (warm-up times seed estimates nobody has measured yet)."""
        for (model, version), warmup in models.items():
            if warmup:
                self._estimates.seed(model, version, warmup)
        slot = self.pool.add(worker_id, models, capacity, self._per_router or in_flight_for(device))
        if not slot.batch_s:
            slot.batch_s = max(self._estimates.batch_seconds(m, v, 1) for m, v in models) if models else 0.0
        slot.registered_ready = ready
        self.pool.refresh(slot)

    def connected(self, worker_id: str, connected: bool) -> None:
        """The stream to the worker came up or went down."""
        slot = self.pool.get(worker_id)
        if slot is not None:
            slot.connected = connected
            self.pool.refresh(slot)

    def reported(self, worker_id: str, ready: bool, queued_batches: int, now: float) -> None:
        """A load report: whether it takes batches, and how many it holds from all routers."""
        slot = self.pool.get(worker_id)
        if slot is not None:
            slot.reported_ready = ready
            self._others(slot, queued_batches, now)

    def remove(self, worker_id: str, *, failed: bool, now: float) -> None:
        """The worker is gone (`failed`: with batches of ours on it, which counts against its breaker)."""
        if failed:
            self.health.breaker.failure(worker_id, now)
        if self.pool.remove(worker_id) is not None:
            self._estimates.forget_worker(worker_id)
        self.health.forget(worker_id)

    def reserve(self, worker: WorkerSlot, dispatch: Dispatch, now: float) -> None:
        """A batch was sent to the worker."""
        breaker = self.health.breaker
        breaker.dispatched(worker.worker_id, now)
        # Brought in line with its breaker before the reservation, whose refresh then serves both.
        worker.allowed = breaker.allows(worker.worker_id, now)
        self.pool.reserve(worker, dispatch.batch_id, dispatch.rows, now, dispatch.expected_s)
        self.health.watch(worker)

    def release(self, dispatch: Dispatch, now: float) -> WorkerSlot | None:
        """A batch left the worker (answered, lost or unsent): free its place."""
        slot = self.pool.get(dispatch.worker_id)
        if slot is not None and dispatch.batch_id in slot.batches:
            self.pool.release(slot, dispatch.batch_id, dispatch.rows, now)
            self.health.watch(slot)
        return slot

    def answered(
        self, worker_id: str, slot: WorkerSlot | None, dispatch: Dispatch, answer: BatchAnswer, now: float
    ) -> Learned | None:
        """Learn from an answer's timing (`slot`: the batch's worker, if still known) and judge `worker_id`,
        which sent it; returns what was learned, if anything."""
        learned = None
        if slot is not None:
            learned = self._learn(slot, dispatch, answer, now)
            if answer.queued_batches is not None:
                self._others(slot, answer.queued_batches, now)
        for item in answer.items.values():  # a loop, not `any` over a generator: this runs per request
            if item.code and item.worker_fault:
                self.health.failed(worker_id, now)
                break
        else:
            self.health.breaker.success(worker_id)
        self.allow(worker_id, now)
        return learned

    def _learn(self, slot: WorkerSlot, dispatch: Dispatch, answer: BatchAnswer, now: float) -> Learned | None:
        """What the batch cost as the router sees the worker (see the module's rules). Besides the forward
        pass this includes the worker's host work and both hops, which decide how soon it can take the
        next batch (the forward alone made a fast model look free, so batches stayed tiny)."""
        previous, slot.last_answer = slot.last_answer, now
        if not answer.executed_rows:
            return None
        seconds = max(answer.execute_s, now - max(dispatch.sent_at, previous))
        slot.batch_s += BATCH_S_WEIGHT * (seconds - slot.batch_s)
        key = dispatch.lane
        observed = answer.executed_rows
        self._estimates.observe(key.model, key.version, observed, seconds, slot.worker_id, shape=key.shape)
        return Learned(dispatch, seconds, answer.execute_s)

    def _others(self, slot: WorkerSlot, queued_batches: int, now: float) -> None:
        """Batches other routers hold on the worker: what it reports minus ours, and when they should be
        done (at its typical batch time each)."""
        slot.others = max(0, queued_batches - slot.in_flight_batches)
        slot.others_free_at = now + slot.others * slot.batch_s
        self.pool.refresh(slot)

    def allow(self, worker_id: str, now: float) -> None:
        """Bring the worker's slot in line with its breaker now."""
        slot = self.pool.get(worker_id)
        if slot is not None:
            slot.allowed = self.health.breaker.allows(worker_id, now)
            self.pool.refresh(slot)
