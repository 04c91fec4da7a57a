"""RouterCore: every decision one router makes, sans-IO, in the manner of h11's `Connection`.

Events go in, each with an explicit `now` — a request arrived or was cancelled, a worker answered a batch,
a send failed, a worker registered, connected, reported its load or left, the tenants or the peer routers
(and their demand) changed, or simply `tick` — and each returns one `Decision` (router/policy/outcomes.py):
batches to send, requests settled with a result or a typed error, items workers should drop, hung workers
to disconnect, and when to tick next. Quota shares have events of their own that return no decision:
`set_peers`, `publish_demand` (what this router should tell its peers now) and `count_published`
(router/policy/shares.py).
The asyncio driver (router/driver.py) and the simulator (bench/sim/engine.py) only translate events and
carry decisions out; every rule has its home here or in a module this one calls.

Rules, and where they live:
1. arrival: a deadline already passed → DEADLINE_EXCEEDED; no accepting worker serves the version →
   UNAVAILABLE `no_worker`; then admission (quotas, deadline budget: admission.py), room for the lane's
   shape (shapes.py: a new shape takes an idle one's place, or is refused UNAVAILABLE `too_many_shapes`)
   and the queue bounds (queues.py), whose refusals and evictions end requests here.
2. queued: a request still waiting at its latest start is shed (UNAVAILABLE while its deadline is ahead,
   DEADLINE_EXCEEDED after); each lane, most urgent first, is cut when the batcher says and sent to the
   worker the chooser picks among those with a free place (planner.py, workers.py).
3. dispatched: a request not answered by its deadline ends DEADLINE_EXCEEDED then and its worker is told
   to drop it; a worker that holds batches and answers none for `hang_after_s` (or `HANG_FACTOR` times
   their estimate) is lost.
4. answered: the batch's time teaches the estimates (from when the worker could start it — sent to an
   idle worker, or its previous answer — to this answer, or the forward time if longer); a failure the
   worker blames on itself counts against its breaker, anything else closes it; each request ends with
   its outcome, DEADLINE_EXCEEDED if it came after the deadline, or goes elsewhere if the worker was busy.
5. lost (worker gone, stream broke, send failed): each request is dispatched once more if its latest start
   allows, else UNAVAILABLE `worker_lost` with a short hint.
6. the version to serve (versions.py `version_to_serve`) and the deadline of a request (`deadline_for`)
   are decided in the policy too; the data plane calls them.
State has one owner each, and none calls back into the core: the in-flight ledger (in_flight.py) and the
worker-health timers (health.py: hang timers, breaker reopens) return what is due; the planner
(planner.py) returns one step per lane; admission takes the lane's `Backlog` (backlog.py) as numbers; the
queues own the lanes and their limits (queues.py). The shell reads the core through `view`
(core_view.py), never its members.
Invariants: a request is queued, dispatched or ended — exactly one; it ends exactly once, and releases
its admission slot then; `now` is never defaulted; state kept per lane shape (lanes, limits, waits,
statistics, fits) exists only for shapes the `ShapeTable` holds.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping

from sluice_inference.common.config import AdmissionSettings, RouterSettings, TenantSettings
from sluice_inference.common.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    SluiceError,
    Unavailable,
    error_for_code,
)
from sluice_inference.common.records import ModelRecord
from sluice_inference.router.policy.admission import AdmissionController, queue_bounds
from sluice_inference.router.policy.backlog import MIN_RETRY_S, Backlog, drain_seconds
from sluice_inference.router.policy.batcher import AdaptiveBatcher, Batcher, HostCost, TimerBatcher
from sluice_inference.router.policy.breaker import CircuitBreaker
from sluice_inference.router.policy.core_view import CoreView
from sluice_inference.router.policy.demand import Demand
from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.health import HANG_FACTOR, WorkerHealth
from sluice_inference.router.policy.in_flight import InFlight
from sluice_inference.router.policy.lane_stats import LaneStats
from sluice_inference.router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest
from sluice_inference.router.policy.outcomes import (
    BatchAnswer,
    Decision,
    Dispatch,
    ItemAnswer,
    Learned,
    Served,
)
from sluice_inference.router.policy.planner import BLOCKED, NO_WORKER, Planner, Send, Wait
from sluice_inference.router.policy.queues import QueueFull, Queues
from sluice_inference.router.policy.scheduler import Chooser, make_chooser
from sluice_inference.router.policy.shapes import ShapeTable
from sluice_inference.router.policy.versions import Serves, version_to_serve
from sluice_inference.router.policy.workers import WorkerPool, WorkerSlot

__all__ = [
    "BUSY",
    "HANG_FACTOR",
    "MIN_RETRY_S",
    "RouterCore",
    "Serves",
    "deadline_for",
    "version_to_serve",
]

NO_WORKER_RETRY_S = 1.0
"""Hint for requests that find no worker serving their model: workers register within seconds."""
WORKER_LOST_RETRY_S = 0.1
"""A worker vanished mid-batch: the request can be retried at once on another worker."""
SHAPES_BUSY_RETRY_S = 0.1
"""Every shape of the model has queued or running work: one of them is idle once a batch is answered."""
ITEM_OVERHEAD_BYTES = 256
"""Framing of one item on the worker stream (ids, names, shapes), counted in a batch's size."""
BATCH_S_WEIGHT = 0.2
"""How fast a worker's typical batch time follows what this router measures there."""
MAX_HOST_S = 1.0
"""Most CPU seconds per batch or per row a shell may report: anything above is a measuring error."""
BUSY = "worker_busy"
"""Item reason of a worker that was full when the batch arrived: place it elsewhere, no one's fault."""


class RouterCore:
    """The policy of one router: queues, in-flight batches, workers, estimates, breaker, admission."""

    def __init__(
        self,
        now: float,
        *,
        settings: RouterSettings,
        admission: AdmissionSettings,
        tenants: dict[str, TenantSettings],
        max_batch_bytes: int | None = None,
        batcher: Batcher | None = None,
        chooser: Chooser | None = None,
        rng: random.Random | None = None,
        shapes: ShapeTable | None = None,
    ) -> None:
        self.settings = settings
        batcher = batcher or (AdaptiveBatcher() if settings.batcher == "adaptive" else TimerBatcher())
        self.planner = Planner(batcher, chooser or make_chooser(settings.scheduler, rng))
        self.estimates = ServiceEstimates()
        self.health = WorkerHealth(settings.worker_hang_s)
        self.workers = WorkerPool()
        self.admission = AdmissionController(admission, tenants, now)
        self.queues = Queues(queue_bounds(admission), admission.aging_s)
        self.ledger = InFlight()
        self.max_batch_bytes = max_batch_bytes
        self.shapes = ShapeTable() if shapes is None else shapes
        """The lane shapes that hold state (the queues' lanes, limits and statistics, the planner's waits
        and the shape fits are kept only for shapes here)."""
        self._batch_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self.view = CoreView(self)
        """What the shell reads of the core (read-only snapshots)."""

    @property
    def in_flight(self) -> Mapping[int, Dispatch]:
        """The batches in flight by id (read-only; the ledger owns them)."""
        return self.ledger.batches

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker (owned by `health`)."""
        return self.health.breaker

    # -- requests ---------------------------------------------------------------------------------------
    def new_request(
        self,
        arrival: float,
        *,
        lane: LaneKey,
        rows: int,
        deadline: float,
        payload: object,
        tenant: str,
        priority: int,
        weight: float = 1.0,
        input_bytes: int = 0,
        response_bytes: int = 0,
        cost: int = 1,
    ) -> QueuedRequest:
        """A request as the core keeps it, with a fresh id; `payload` is the shell's and never looked at.
        `arrival` is when it reached the router (its whole budget is `deadline - arrival`).
        What it weighs on the worker stream (its inputs, its expected outputs and their framing) is what
        batches are cut by to fit the cluster's message limit."""
        return QueuedRequest(
            next(self._request_ids), lane, rows, arrival, deadline, payload, tenant=tenant, priority=priority,
            weight=weight, size_bytes=input_bytes, cost=cost,
            wire_bytes=input_bytes + response_bytes + ITEM_OVERHEAD_BYTES,
        )  # fmt: skip

    def limits(self, record: ModelRecord) -> LaneLimits:
        """The batching limits of a model version's lanes."""
        limits = (record.max_batch_size, record.max_wait_s, record.max_batch_cost, self.max_batch_bytes)
        return LaneLimits(*limits)

    def arrive(self, now: float, request: QueuedRequest, limits: LaneLimits) -> Decision:
        """A validated request: refuse it now, or admit and queue it (evicting less important work)."""
        decision = Decision()
        key = request.lane
        if request.deadline <= now:
            expired = DeadlineExceeded("deadline already passed on arrival", reason="expired_on_arrival")
            self._end(decision, request, expired)
        elif not self.serves(key.model, key.version):
            self._end(decision, request, _no_worker(key))
        else:
            try:
                self.admission.admit(request, limits, now, self._backlog(key, request.priority))
                self._make_room(key)
                self.queues.set_limits(key, limits)
                self._queue(decision, request)
            except SluiceError as refused:
                self._end(decision, request, refused)
            else:  # only its own lane can have changed: no need for a whole tick
                lane = self.queues.lanes[key]
                waits_until = self.planner.still_waiting(lane, request, now, self.workers.epoch)
                if waits_until is not None:
                    decision.wake(waits_until)
                else:
                    self._drain(decision, lane, now)
                decision.wake(lane.earliest_latest_start())
        return decision

    def _backlog(self, key: LaneKey, priority: int) -> Backlog:
        """What the lane holds ahead of a newcomer of `priority`, for admission."""
        lane = self.queues.lanes.get(key)
        serving = self.workers.serving_count((key.model, key.version))
        return Backlog(
            self.estimates,
            self.queues.rows_ahead(key, priority),
            self.workers_full(key),
            lane.limits.max_batch_size if lane is not None else 1,
            max(1, serving),
        )

    def _make_room(self, key: LaneKey) -> None:
        """Keep state for the lane's shape: it takes the place of its model's least recently used idle
        shape, whose state is dropped, or is refused when every shape of the model is busy."""
        forgotten = self.shapes.use(key, self._busy)
        if forgotten is None:
            raise Unavailable(
                f"model {key.model} has {self.shapes.limit} distinct input shapes queued or running; "
                "configure shape buckets for its variable dims, or retry",
                reason="too_many_shapes",
                retry_after_s=SHAPES_BUSY_RETRY_S,
            )
        for idle in forgotten:
            self.queues.forget(idle)
            self.planner.forget(idle)
            self.estimates.forget_shape(idle.model, idle.version, idle.shape)

    def _busy(self, key: LaneKey) -> bool:
        return self.queues.busy(key) or self.ledger.lane_busy(key)

    def _queue(self, decision: Decision, request: QueuedRequest) -> None:
        """Queue a request; requests it evicts end UNAVAILABLE `shed`; raises UNAVAILABLE `queue_full`
        (with the lane's drain time as hint) if it does not fit."""
        try:
            victims = self.queues.push(request)
        except QueueFull as full:
            hint = self.drain_seconds(request.lane)
            raise Unavailable(f"queue full: {full}", reason="queue_full", retry_after_s=hint) from None
        for victim in victims:
            shed = Unavailable(
                "shed to make room for higher-priority work",
                reason="shed",
                retry_after_s=self.drain_seconds(victim.lane),
            )
            self._end(decision, victim, shed)

    def charge(self, now: float, tenant: str) -> None:
        """A request of `tenant` answered without the queue (a cache hit) pays the tenant's rate
        (admission.py `charge`), or raises RESOURCE_EXHAUSTED."""
        self.admission.charge(tenant, now)

    def cancel(self, now: float, request_id: int) -> Decision:
        """The client went away: the request leaves its queue, or its worker is told to skip it."""
        decision = Decision()
        request = self.queues.remove(request_id)
        if request is None:
            dispatch = self.ledger.holding(request_id)
            if dispatch is not None:
                request = next(r for r in dispatch.requests if r.request_id == request_id)
                if not request.ended:
                    decision.drop(dispatch.worker_id, request_id)
        if request is not None and not request.ended:
            self._end(decision, request, Cancelled("the client went away", reason="cancelled"))
        return self._then_tick(decision, now)

    # -- workers ----------------------------------------------------------------------------------------
    def worker_registered(
        self,
        now: float,
        worker_id: str,
        models: Mapping[tuple[str, str], Mapping[int, float]],
        capacity: int,
        ready: bool,
    ) -> Decision:
        """A worker's registration appeared or changed: its model versions (each with the forward time by
        batch size it measured at warm-up, which seeds estimates nobody has measured yet), its capacity
        (batches it holds at once, all routers together), ready or draining."""
        for (model, version), warmup in models.items():
            if warmup:
                self.estimates.seed(model, version, warmup)
        slot = self.workers.add(worker_id, models, capacity, self.settings.batches_in_flight_per_worker)
        if not slot.batch_s:
            slot.batch_s = max(self.estimates.batch_seconds(m, v, 1) for m, v in models) if models else 0.0
        slot.registered_ready = ready
        self.workers.refresh(slot)
        return self.tick(now)

    def worker_connected(self, now: float, worker_id: str, connected: bool) -> Decision:
        """The stream to a worker came up (it takes batches once it also reports READY) or went down."""
        slot = self.workers.get(worker_id)
        if slot is not None:
            slot.connected = connected
            self.workers.refresh(slot)
        return self.tick(now)

    def worker_reported(self, now: float, worker_id: str, ready: bool, queued_batches: int) -> Decision:
        """A load report: whether the worker takes batches, and how many it holds from all routers."""
        slot = self.workers.get(worker_id)
        if slot is not None:
            slot.reported_ready = ready
            self._others(slot, queued_batches, now)
        return self.tick(now)

    def worker_left(self, now: float, worker_id: str, why: str) -> Decision:
        """A worker is gone (deregistered, stream broke): its batches are dispatched once more if their
        requests' deadlines allow, else they end UNAVAILABLE."""
        decision = Decision()
        self._gone(decision, worker_id, why, now)
        return self._then_tick(decision, now)

    def _gone(self, decision: Decision, worker_id: str, why: str, now: float) -> None:
        slot = self.workers.get(worker_id)
        lost = [d for d in map(self.ledger.get, slot.batches if slot else ()) if d is not None]
        if lost:
            self.health.breaker.failure(worker_id, now)
        for dispatch in lost:
            self.ledger.forget(dispatch)
            self._lost(decision, dispatch, why, now)
        if self.workers.remove(worker_id) is not None:
            self.estimates.forget_worker(worker_id)
        self.health.forget(worker_id)

    def send_failed(self, now: float, batch_id: int, why: str) -> Decision:
        """A batch could not be sent: its requests go elsewhere if they can, like a lost worker's."""
        decision = Decision()
        dispatch = self.ledger.get(batch_id)
        if dispatch is not None:
            self._settle_batch(dispatch, now)
            self._lost(decision, dispatch, why, now)
        return self._then_tick(decision, now)

    def answered(self, now: float, worker_id: str, answer: BatchAnswer) -> Decision:
        """A worker answered a batch: learn from its timing, judge the worker, end each request."""
        decision = Decision()
        dispatch = self.ledger.get(answer.batch_id)
        if dispatch is None:
            return self._then_tick(decision, now)  # answered after it was lost or failed: nothing is owed
        slot = self._settle_batch(dispatch, now)
        if slot is not None:
            self._learn(decision, slot, dispatch, answer, now)
            if answer.queued_batches is not None:
                self._others(slot, answer.queued_batches, now)
        if any(item.code and item.worker_fault for item in answer.items.values()):
            self.health.failed(worker_id, now)
        else:
            self.health.breaker.success(worker_id)
        self._allow(worker_id, now)
        stats, items = self.queues.stats_of(dispatch.lane), answer.items
        for request in dispatch.requests:
            if not request.ended:
                self._outcome(decision, dispatch, request, items.get(request.request_id), now, stats=stats)
        return self._then_tick(decision, now)

    def fail_batch(self, now: float, batch_id: int, error: SluiceError) -> Decision:
        """End a batch's requests with `error` (the shell could not handle its answer): nothing else."""
        decision = Decision()
        dispatch = self.ledger.get(batch_id)
        if dispatch is not None:
            self._settle_batch(dispatch, now)
            for request in dispatch.requests:
                self._end(decision, request, error)
        return decision

    def abandon(self, now: float, error: SluiceError) -> Decision:
        """End every queued and in-flight request with `error`: the router is stopping, or its loop is
        stuck. The workers' places are given back; the core can go on afterwards."""
        decision = Decision()
        for lane in list(self.queues.lanes.values()):
            for request in list(lane):
                lane.remove(request.request_id)
                self._end(decision, request, error)
        for batch_id in self.ledger:
            decision.settled.extend(self.fail_batch(now, batch_id, error).settled)
        return decision

    # -- tenants, peers and the host --------------------------------------------------------------------
    def set_tenants(self, now: float, tenants: dict[str, TenantSettings]) -> None:
        """Apply reloaded tenant quotas (config reload or etcd `tenants/` overrides)."""
        self.admission.set_tenants(tenants, now)

    def set_peers(self, now: float, peers: Mapping[str, Demand] | None) -> None:
        """The other live routers sharing the cluster-wide quotas, with the demand each published; None
        while they cannot be known (etcd unreachable): the equal split over the routers last known."""
        self.admission.set_peers(peers, now)

    def publish_demand(self, now: float) -> Demand | None:
        """A publish round: the demand this router should publish now, if it moved materially."""
        return self.admission.publish_demand(now)

    def count_published(self, now: float) -> None:
        """The demand last published has had `OWN_GRACE_S` to reach the peers: count it in full."""
        self.admission.count_published(now)

    def publish_interval_s(self) -> float:
        """How long a shell waits between two publish rounds (stretched with many routers)."""
        return self.admission.publish_interval_s()

    def host_load(self, now: float, *, batch_s: float, row_s: float, constrained: bool) -> Decision:
        """What the router's own CPU spends per batch and per row (the shell measures it), and whether it is
        the constraint now (calls wait to reach the router's code: the door's delay is above its bound).
        While it is, the adaptive batcher's target is at least the batch the router keeps up with
        (batcher.py), so batches fill because the router's CPU is short, never at low load. Raises
        ValueError for a cost outside 0..`MAX_HOST_S`."""
        for name, value in (("batch_s", batch_s), ("row_s", row_s)):
            if not 0.0 <= value <= MAX_HOST_S:  # NaN fails too
                raise ValueError(f"host_load: {name} must lie in 0..{MAX_HOST_S} s, not {value!r}")
        self.planner.set_host(HostCost(batch_s, row_s, constrained))
        return self.tick(now)

    # -- time -------------------------------------------------------------------------------------------
    def tick(self, now: float) -> Decision:
        """Shed late queued requests, end overdue dispatched ones, find hung workers, reopen breakers, cut
        every batch that should leave now; say when to tick again."""
        decision = Decision()
        for request in self.queues.pop_late(now):
            self._end(decision, request, self._late(request, now))
        for dispatch, overdue in self.ledger.overdue(now):
            for request in overdue:
                late = DeadlineExceeded(
                    "deadline passed before the worker answered", reason="expired_on_worker"
                )
                self._end(decision, request, late)
                decision.drop(dispatch.worker_id, request.request_id)
        decision.wake(self.ledger.next_overdue())
        for worker_id in self.health.hung(now):
            decision.lost.append(worker_id)
            self._gone(decision, worker_id, "hung: no progress while holding batches", now)
        decision.wake(self.health.next_hang())
        for worker_id in self.health.reopened(now):
            self._allow(worker_id, now)
        decision.wake(self.health.next_reopen())
        for lane in self.queues.by_urgency(now):
            self._drain(decision, lane, now)
        self.queues.prune()
        decision.wake(self.queues.next_late())
        return decision

    def _then_tick(self, decision: Decision, now: float) -> Decision:
        """`decision` followed by a tick (an event can free a place or end a batch's wait)."""
        ticked = self.tick(now)
        decision.dispatches.extend(ticked.dispatches)
        decision.settled.extend(ticked.settled)
        for worker_id, items in ticked.drops.items():
            decision.drops.setdefault(worker_id, []).extend(items)
        decision.lost.extend(ticked.lost)
        decision.wake(ticked.wake_at)
        return decision

    def _late(self, request: QueuedRequest, now: float) -> SluiceError:
        if now >= request.deadline:
            return DeadlineExceeded("deadline passed while queued", reason="expired_in_queue")
        return Unavailable(
            f"shed before its deadline: {(request.deadline - now) * 1000:.1f} ms left is less than the "
            "estimated time to run it",
            reason="deadline_unmeetable",
            retry_after_s=self.drain_seconds(request.lane),
        )

    # -- batches ----------------------------------------------------------------------------------------
    def _drain(self, decision: Decision, lane: Lane, now: float) -> None:
        try:
            self._drain_lane(decision, lane, now)
        except Exception as exc:  # a bug in one lane's decision fails that lane, not the router
            self._fail_lane(decision, lane, exc)

    def _drain_lane(self, decision: Decision, lane: Lane, now: float) -> None:
        """Carry out the planner's steps for the lane until it waits, is blocked or is empty."""
        key = lane.key
        version = (key.model, key.version)
        if self.workers.serving_count(version) and not self.workers.free_count(version):
            return  # every worker is full or breaker-blocked (what the chooser would find, at once)
        stats = self.queues.stats_of(key)
        while len(lane):
            rate = self.queues.total_arrival_rate(now) if self.planner.host.constrained else 0.0
            step = self.planner.step(
                lane, now, workers=self.workers, estimates=self.estimates, stats=stats,
                routers=self.admission.limiter.routers, arrival_rate=rate,
            )  # fmt: skip
            if isinstance(step, Send):
                self._send(decision, step.worker, lane, step.reason, now)
                continue
            if isinstance(step, Wait):
                decision.wake(step.when)
            elif step == NO_WORKER:
                for request in list(lane):
                    lane.remove(request.request_id)
                    self._end(decision, request, _no_worker(key))
            else:
                assert step == BLOCKED
            return

    def _send(self, decision: Decision, worker: WorkerSlot, lane: Lane, reason: str, now: float) -> None:
        key = lane.key
        requests = tuple(lane.pop_batch(now))
        rows = sum(r.rows for r in requests)
        expected = self.estimates.batch_seconds(key.model, key.version, rows, worker.worker_id, key.shape)
        dispatch = Dispatch(
            next(self._batch_ids), worker.worker_id, key, requests, reason, expected, now, rows
        )
        self.ledger.add(dispatch)
        self.workers.reserve(worker, dispatch.batch_id, rows, now, expected)
        self.health.breaker.dispatched(worker.worker_id, now)
        self._allow(worker.worker_id, now)
        self.health.watch(worker)
        decision.dispatches.append(dispatch)

    def _fail_lane(self, decision: Decision, lane: Lane, exc: Exception) -> None:
        error = Internal(
            f"the router failed to schedule this request ({type(exc).__name__})", reason="internal"
        )
        error.__cause__ = exc
        for request in list(lane):
            lane.remove(request.request_id)
            self._end(decision, request, error)

    def _settle_batch(self, dispatch: Dispatch, now: float) -> WorkerSlot | None:
        """A batch is no longer in flight (answered, lost or unsent): free its worker's place."""
        self.ledger.forget(dispatch)
        slot = self.workers.get(dispatch.worker_id)
        if slot is not None and dispatch.batch_id in slot.batches:
            self.workers.release(slot, dispatch.batch_id, dispatch.rows, now)
            self.health.watch(slot)
        return slot

    def _learn(
        self, decision: Decision, slot: WorkerSlot, dispatch: Dispatch, answer: BatchAnswer, now: float
    ) -> None:
        """What the batch cost as the router sees the worker: from when the worker could start it (sent to
        an idle worker, or its previous answer) to this answer. Besides the forward pass this includes the
        worker's host work and both hops, which decide how soon it can take the next batch (the forward
        alone made a fast model look free, so batches stayed tiny)."""
        previous, slot.last_answer = slot.last_answer, now
        if not answer.executed_rows:
            return
        seconds = max(answer.execute_s, now - max(dispatch.sent_at, previous))
        slot.batch_s += BATCH_S_WEIGHT * (seconds - slot.batch_s)
        key = dispatch.lane
        observed = answer.executed_rows
        self.estimates.observe(key.model, key.version, observed, seconds, slot.worker_id, shape=key.shape)
        decision.learned.append(Learned(dispatch, seconds, answer.execute_s))

    def _outcome(
        self,
        decision: Decision,
        dispatch: Dispatch,
        request: QueuedRequest,
        item: ItemAnswer | None,
        now: float,
        *,
        stats: LaneStats,
    ) -> None:
        """End one request of an answered batch (`stats`: its lane's, which learn how much of its budget it
        used)."""
        if item is None:
            missing = Internal(f"worker {dispatch.worker_id} returned no outcome for this request")
            self._end(decision, request, missing)
        elif item.code and item.reason == BUSY:
            busy = Unavailable(item.message, reason=BUSY, retry_after_s=MIN_RETRY_S)
            self._again_or_end(decision, request, busy, now, charge=False)
        elif item.code:
            self._end(decision, request, error_for_code(item.code, item.message, reason="worker_error"))
        elif now > request.deadline:
            late = DeadlineExceeded("finished after its deadline", reason="finished_late")
            self._end(decision, request, late)
        else:
            budget = request.deadline - request.arrival
            if budget > 0:
                stats.finished((now - request.arrival) / budget)
            queue_s = dispatch.sent_at - request.arrival
            self._end(decision, request, Served(dispatch.worker_id, dispatch.rows, queue_s, item.outputs))

    def _lost(self, decision: Decision, dispatch: Dispatch, why: str, now: float) -> None:
        error = Unavailable(
            f"worker {dispatch.worker_id} was lost before answering ({why})",
            reason="worker_lost",
            retry_after_s=WORKER_LOST_RETRY_S,
        )
        for request in dispatch.requests:
            if not request.ended:
                self._again_or_end(decision, request, error, now, charge=True)

    def _again_or_end(
        self, decision: Decision, request: QueuedRequest, error: SluiceError, now: float, *, charge: bool
    ) -> None:
        """Queue a request again — at most once for `charge`d causes (a lost worker), and only while its
        latest start has not come — else end it with `error`."""
        if (charge and request.attempts > 1) or now >= request.latest_start:
            self._end(decision, request, error)
            return
        if charge:
            request.attempts += 1
        try:
            self._queue(decision, request)
        except SluiceError as refused:
            self._end(decision, request, refused)

    def _end(self, decision: Decision, request: QueuedRequest, outcome: Served | SluiceError) -> None:
        """End a request exactly once; its admission slot is released."""
        if request.ended:
            return
        request.ended = True
        self.admission.release(request)
        decision.settle(request, outcome)

    # -- workers' load and health ----------------------------------------------------------------------
    def _others(self, slot: WorkerSlot, queued_batches: int, now: float) -> None:
        """Batches other routers hold on the worker: what it reports minus ours, and when they should be
        done (at its typical batch time each)."""
        slot.others = max(0, queued_batches - slot.in_flight_batches)
        slot.others_free_at = now + slot.others * slot.batch_s
        self.workers.refresh(slot)

    def _allow(self, worker_id: str, now: float) -> None:
        slot = self.workers.get(worker_id)
        if slot is not None:
            slot.allowed = self.health.breaker.allows(worker_id, now)
            self.workers.refresh(slot)

    # -- questions (the shell reads them through `view`) -------------------------------------------------
    def serves(self, model: str, version: str) -> bool:
        """Whether some accepting worker has this model version."""
        return self.workers.serving_count((model, version)) > 0

    def rows_ahead(self, key: LaneKey, priority: int) -> int:
        """Rows queued in the lane at this priority or better (admission's view)."""
        return self.queues.rows_ahead(key, priority)

    def workers_full(self, key: LaneKey) -> bool:
        """Whether every worker serving the lane's version is full (admission's view)."""
        version = (key.model, key.version)
        return self.workers.serving_count(version) > 0 and not self.workers.free_count(version)

    def drain_seconds(self, key: LaneKey, rows: int | None = None) -> float:
        """Estimated time for the workers serving `key` to work through `rows` (default: the whole lane)."""
        lane = self.queues.lanes.get(key)
        if rows is None:
            rows = lane.rows if lane is not None else 0
        batch = lane.limits.max_batch_size if lane is not None else 1
        workers = max(1, self.workers.serving_count((key.model, key.version)))
        return drain_seconds(self.estimates, key, rows, batch, workers)

    def shape_state(self) -> dict[str, int]:
        """Entries of each table kept per lane shape (each bounded by the `ShapeTable`'s limit per model)."""
        return {
            "shapes": len(self.shapes),
            "lanes": len(self.queues.lanes),
            "lane_stats": len(self.queues.stats),
            "lane_limits": len(self.queues.limits),
            "waiting": len(self.planner),
            "lanes_in_flight": self.ledger.lanes_busy(),
            "fits": self.estimates.fits(),
        }

    def accepting(self, worker_id: str) -> bool:
        """Whether the worker takes batches from this router now."""
        slot = self.workers.get(worker_id)
        return slot is not None and slot.accepting

    def in_flight_on(self, worker_id: str) -> int:
        """Batches this router has in flight on a worker."""
        slot = self.workers.get(worker_id)
        return 0 if slot is None else slot.in_flight_batches


def deadline_for(
    settings: RouterSettings, now: float, time_remaining: float | None, timeout_s: float | None
) -> float:
    """A request's deadline: the earlier of its transport deadline and `parameters["timeout"]`, else the
    default; never further than `max_timeout_s` (a request may only shorten the server's limit)."""
    budgets = [t for t in (time_remaining, timeout_s) if t is not None]
    return now + min(*(budgets or [settings.default_timeout_s]), settings.max_timeout_s)


def _no_worker(key: LaneKey) -> Unavailable:
    return Unavailable(
        f"no ready worker serves {key.model} version {key.version}",
        reason="no_worker",
        retry_after_s=NO_WORKER_RETRY_S,
    )
