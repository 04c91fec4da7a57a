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
1. arrival (`arrive`): a deadline already passed → DEADLINE_EXCEEDED; no accepting worker serves the
   version → UNAVAILABLE `no_worker`; then admission (admission.py), room for the lane's shape (shapes.py,
   else UNAVAILABLE `too_many_shapes`) and the queue bounds (queues.py).
2. queued (`tick`): a request still waiting at its latest start is shed (endings.py `late`); each lane,
   most urgent first, goes where the planner says (planner.py).
3. dispatched: an overdue request ends DEADLINE_EXCEEDED and its worker is told to drop it (in_flight.py);
   a worker holding batches without progress is lost (health.py).
4. answered, lost, refused: the fleet learns and judges the worker (fleet.py); each request ends, or is
   queued once more, by the rules of endings.py.
5. the version to serve (versions.py) is policy too; a request's deadline, every margin taken off it and
   every rule that ends a request for lack of time are the deadline budget's (deadline_budget.py).
Each piece of state has one owner, and none calls back into the core: the ledger and the health timers
return what is due, the planner one step per lane; admission takes a `Backlog` of numbers (backlog.py);
the queues own the lanes and their limits. The shell reads the core through `view` (core_view.py).
Invariants: a request is queued, dispatched or ended — exactly one; it ends exactly once, and releases
its admission slot then; `now` is never defaulted; state kept per lane shape (lanes, limits, waits,
statistics, fits) exists only for shapes the `ShapeTable` holds.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Final

from sluice_inference.common.errors import (
    Cancelled,
    SluiceError,
    Unavailable,
)
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings, TenantSettings
from sluice_inference.router.policy.admission import AdmissionController, queue_bounds
from sluice_inference.router.policy.backlog import MIN_RETRY_S, Backlog
from sluice_inference.router.policy.batcher import PRESSED, AdaptiveBatcher, Batcher, HostCost, TimerBatcher
from sluice_inference.router.policy.breaker import CircuitBreaker
from sluice_inference.router.policy.core_view import CoreView
from sluice_inference.router.policy.deadline_budget import DeadlineBudget
from sluice_inference.router.policy.demand import Demand
from sluice_inference.router.policy.dispatching import Dispatcher
from sluice_inference.router.policy.endings import BUSY, Endings, no_worker
from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.fleet import Fleet
from sluice_inference.router.policy.health import HANG_FACTOR
from sluice_inference.router.policy.in_flight import InFlight
from sluice_inference.router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest
from sluice_inference.router.policy.outcomes import (
    BatchAnswer,
    Decision,
    Dispatch,
)
from sluice_inference.router.policy.planner import Planner
from sluice_inference.router.policy.queues import Queues
from sluice_inference.router.policy.scheduler import Chooser, make_chooser
from sluice_inference.router.policy.shapes import ShapeTable
from sluice_inference.router.policy.versions import Serves, version_to_serve

__all__ = [
    "BUSY",
    "HANG_FACTOR",
    "MIN_RETRY_S",
    "RouterCore",
    "Serves",
    "version_to_serve",
]

SHAPES_BUSY_RETRY_S: Final = 0.1
"""Every shape of the model has queued or running work: one of them is idle once a batch is answered."""
ITEM_OVERHEAD_BYTES: Final = 256
"""Framing of one item on the worker stream (ids, names, shapes), counted in a batch's size."""
MAX_CAPPED_LIMITS: Final = 1024
"""Distinct lane limits remembered with a message cap added (registered model versions have a handful),
least recently used first out."""


@lru_cache(maxsize=MAX_CAPPED_LIMITS)
def with_message_cap(limits: LaneLimits, max_batch_bytes: int) -> LaneLimits:
    """`limits` with the cluster's message cap: asked per request, built once per distinct limits (a
    changed registration brings other limits, so another entry)."""
    return replace(limits, max_batch_bytes=max_batch_bytes)


DecisionObserver = Callable[[str, Decision], None]
"""Told each decision an event of the core returns, with the event's name (`RouterCore.observer`)."""


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
        observer: DecisionObserver | None = None,
    ) -> None:
        self.settings = settings
        self.observer = observer
        """Told every decision an event returns, with the event's name: a decision log for debugging, and
        how tests hold two shells to one log (the core is compiled, so they cannot subclass it)."""
        batcher = batcher or (AdaptiveBatcher() if settings.batcher == "adaptive" else TimerBatcher())
        self.planner = Planner(batcher, chooser or make_chooser(settings.scheduler, rng))
        self.estimates = ServiceEstimates()
        self.fleet = Fleet(self.estimates, settings.worker_hang_s, settings.batches_in_flight_per_worker)
        self.workers = self.fleet.pool
        """The workers' slots (owned by the fleet; the same object, for reading)."""
        self.admission = AdmissionController(admission, tenants, now)
        self.queues = Queues(queue_bounds(admission), admission.aging_s)
        self.ledger = InFlight()
        self.endings = Endings(self.admission, self.queues, self.workers, self.estimates)
        self.dispatcher = Dispatcher(
            self.planner, self.fleet, self.ledger, self.endings,
            estimates=self.estimates, queues=self.queues, limiter=self.admission.limiter,
        )  # fmt: skip
        self.max_batch_bytes = max_batch_bytes
        self.shapes = ShapeTable() if shapes is None else shapes
        """The lane shapes that hold state (the queues' lanes, limits and statistics, the planner's waits
        and the shape fits are kept only for shapes here)."""
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
        return self.fleet.health.breaker

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
        limits: LaneLimits,
        weight: float = 1.0,
        input_bytes: int = 0,
        response_bytes: int = 0,
        cost: int = 1,
    ) -> QueuedRequest:
        """A request as the core keeps it, with a fresh id; `payload` is the shell's and never looked at.
        `arrival` is when it reached the router (its whole budget is `deadline - arrival`); it carries its
        model version's `limits` (`LaneLimits.of(record)`) to `arrive`. What it weighs on the worker stream
        (inputs, expected outputs, framing) is what batches are cut by to fit the cluster's message limit,
        the core's `max_batch_bytes`, which is added to its limits here."""
        if self.max_batch_bytes is not None:
            limits = with_message_cap(limits, self.max_batch_bytes)
        wire_bytes = input_bytes + response_bytes + ITEM_OVERHEAD_BYTES
        # Every field in order, positionally (keywords cost as much again as the rest, once per arrival):
        # the request's own, then no dispatch yet (attempts 1), and its latest start at the deadline.
        return QueuedRequest(
            next(self._request_ids), lane, rows, arrival, deadline, payload, limits, tenant, priority, weight,
            input_bytes, cost, wire_bytes, 1, deadline,
        )  # fmt: skip

    def arrive(self, now: float, request: QueuedRequest) -> Decision:
        """A validated request: refuse it now, or admit and queue it (evicting less important work) under
        the lane limits it carries (ValueError without them)."""
        if (limits := request.limits) is None:
            raise ValueError(f"request {request.request_id} arrived without its lane limits")
        decision = Decision()
        key = request.lane
        version = (key.model, key.version)
        serving = self.workers.serving_count(version)  # asked once: `serves`, then the backlog's count
        if (expired := DeadlineBudget.expired_on_arrival(request.deadline, now)) is not None:
            self.endings.end(decision, request, expired)
        elif not serving:
            self.endings.end(decision, request, no_worker(key))
        else:
            # Asked once: nothing below changes a worker's slot before the drain.
            full = not self.workers.free_count(version)
            lane = self.queues.lanes.get(key)  # asked once: None until this request makes it
            try:
                self.admission.admit(
                    request, limits, now, self._backlog(lane, serving, full, request.priority)
                )
                self._make_room(key)
                self.endings.queue(decision, request, limits)
            except SluiceError as refused:
                self.endings.refused(decision, request, refused)
            else:  # only its own lane can have changed: no need for a whole tick
                if lane is None:
                    lane = self.queues.lanes[key]
                waits_until = self.planner.still_waiting(lane, request, now, self.workers.epoch)
                if waits_until is not None:
                    decision.wake(waits_until)
                elif not full:  # every serving worker full: the drain would stop at once (dispatching.py)
                    self.dispatcher.drain(decision, lane, now)
                decision.wake(lane.earliest_latest_start())
        return self._told("arrive", decision)

    def _backlog(self, lane: Lane | None, serving: int, full: bool, priority: int) -> Backlog:
        """What the lane (None: none queued yet) holds ahead of a newcomer of `priority`, for admission
        (`serving`: the accepting workers serving the lane's version, at least one; `full`: none of them
        has a free place)."""
        if lane is None:
            return Backlog(self.estimates, 0, full, 1, serving)
        return Backlog(
            self.estimates, lane.rows_ahead_of(priority), full, lane.limits.max_batch_size, serving
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
            self.endings.end(decision, request, Cancelled("the client went away", reason="cancelled"))
        return self._told("cancel", self._then_tick(decision, now))

    # -- workers ----------------------------------------------------------------------------------------
    def worker_registered(
        self,
        now: float,
        worker_id: str,
        models: Mapping[tuple[str, str], Mapping[int, float]],
        capacity: int,
        ready: bool,
        *,
        device: str,
    ) -> Decision:
        """A worker's registration appeared or changed: its model versions (each with the forward time by
        batch size it measured at warm-up, which seeds estimates nobody has measured yet), its capacity
        (batches it holds at once, all routers together), ready or draining, and its device (how many
        batches this router keeps on it by default)."""
        self.fleet.registered(worker_id, models, capacity, ready, device)
        return self.tick(now)

    def worker_connected(self, now: float, worker_id: str, connected: bool) -> Decision:
        """The stream to a worker came up (it takes batches once it also reports READY) or went down."""
        self.fleet.connected(worker_id, connected)
        return self.tick(now)

    def worker_reported(self, now: float, worker_id: str, ready: bool, queued_batches: int) -> Decision:
        """A load report: whether the worker takes batches, and how many it holds from all routers."""
        self.fleet.reported(worker_id, ready, queued_batches, now)
        return self.tick(now)

    def worker_left(self, now: float, worker_id: str, why: str) -> Decision:
        """A worker is gone (deregistered, stream broke): its batches are dispatched once more if their
        requests' deadlines allow, else they end UNAVAILABLE."""
        decision = Decision()
        self._gone(decision, worker_id, why, now)
        return self._told("worker_left", self._then_tick(decision, now))

    def _gone(self, decision: Decision, worker_id: str, why: str, now: float) -> None:
        slot = self.workers.get(worker_id)
        lost = [d for d in map(self.ledger.get, slot.batches if slot else ()) if d is not None]
        for dispatch in lost:
            self.ledger.forget(dispatch)
            self.endings.lost(decision, dispatch, why, now)
        self.fleet.remove(worker_id, failed=bool(lost), now=now)

    def send_failed(self, now: float, batch_id: int, why: str) -> Decision:
        """A batch could not be sent: its requests go elsewhere if they can, like a lost worker's."""
        decision = Decision()
        dispatch = self.ledger.get(batch_id)
        if dispatch is not None:
            self.dispatcher.settle(dispatch, now)
            self.endings.lost(decision, dispatch, why, now)
        return self._told("send_failed", self._then_tick(decision, now))

    def answered(self, now: float, worker_id: str, answer: BatchAnswer) -> Decision:
        """A worker answered a batch: learn from its timing, judge the worker, end each request."""
        decision = Decision()
        dispatch = self.ledger.get(answer.batch_id)
        if dispatch is None:
            # answered after it was lost or failed: nothing is owed
            return self._told("answered", self._then_tick(decision, now))
        slot = self.dispatcher.settle(dispatch, now)
        learned = self.fleet.answered(worker_id, slot, dispatch, answer, now)
        if learned is not None:
            decision.learned.append(learned)
        self.endings.answered(
            decision, dispatch, answer.items, now, stats=self.queues.stats_of(dispatch.lane)
        )
        return self._told("answered", self._then_tick(decision, now))

    def fail_batch(self, now: float, batch_id: int, error: SluiceError) -> Decision:
        """End a batch's requests with `error` (the shell could not handle its answer): nothing else."""
        return self._told("fail_batch", self._fail(batch_id, error, now))

    def _fail(self, batch_id: int, error: SluiceError, now: float) -> Decision:
        decision = Decision()
        dispatch = self.ledger.get(batch_id)
        if dispatch is not None:
            self.dispatcher.settle(dispatch, now)
            for request in dispatch.requests:
                self.endings.end(decision, request, error)
        return decision

    def abandon(self, now: float, error: SluiceError) -> Decision:
        """End every queued and in-flight request with `error`: the router is stopping, or its loop is
        stuck. The workers' places are given back; the core can go on afterwards."""
        decision = Decision()
        for lane in list(self.queues.lanes.values()):
            for request in list(lane):
                lane.remove(request.request_id)
                self.endings.end(decision, request, error)
        for batch_id in self.ledger:
            decision.settled.extend(self._fail(batch_id, error, now).settled)
        return self._told("abandon", decision)

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

    def host_load(
        self, now: float, *, batch_s: float, row_s: float, constrained: bool, pressure: float
    ) -> Decision:
        """What the router's own CPU spends per batch and per row (the shell measures it), whether it is
        the constraint now (calls wait to reach the router's code: the door's delay is above its bound),
        and its CPU pressure (the share of the time its event loop runs or waits to run, 0..1). While it
        is constrained, the adaptive batcher's target is at least the batch the router keeps up with; while
        the pressure is high, a lane holds for a fuller batch instead of cutting for an idle worker
        (batcher.py): batches fill because the router's CPU is short, never at low load. While it is
        constrained or pressed, no deadline refusal is terminal (deadline_budget.py). Raises ValueError
        for a cost outside 0..`MAX_HOST_S` or a pressure outside 0..1 (planner.py)."""
        host = HostCost(
            batch_s, row_s, constrained, pressure=pressure, hold_factor=self.settings.pressure_hold_factor
        )
        self.planner.set_host(host)
        self.admission.router_pressed = constrained or pressure > PRESSED
        return self.tick(now)

    # -- time -------------------------------------------------------------------------------------------
    def tick(self, now: float) -> Decision:
        """Shed late queued requests, end overdue dispatched ones, find hung workers, reopen breakers, cut
        every batch that should leave now; say when to tick again."""
        return self._told("tick", self._then_tick(Decision(), now))

    def _told(self, event: str, decision: Decision) -> Decision:
        if self.observer is not None:
            self.observer(event, decision)
        return decision

    def _then_tick(self, decision: Decision, now: float) -> Decision:
        """`decision` followed by a tick (an event can free a place or end a batch's wait), which adds to
        it: what the tick decides comes after what the event did, and the earlier wake stands."""
        for request in self.queues.pop_late(now):
            self.endings.end(decision, request, self.endings.late(request, now))
        for dispatch, overdue in self.ledger.overdue(now):
            for request in overdue:
                self.endings.end(decision, request, DeadlineBudget.expired_on_worker())
                decision.drop(dispatch.worker_id, request.request_id)
        decision.wake(self.ledger.next_overdue())
        health = self.fleet.health
        for worker_id in health.hung(now):
            decision.lost.append(worker_id)
            self._gone(decision, worker_id, "hung: no progress while holding batches", now)
        decision.wake(health.next_hang())
        for worker_id in health.reopened(now):
            self.fleet.allow(worker_id, now)
        decision.wake(health.next_reopen())
        for lane in self.queues.by_urgency(now):
            self.dispatcher.drain(decision, lane, now)
        self.queues.prune()
        decision.wake(self.queues.next_late())
        return decision

    # -- questions (the shell reads them through `view`) -------------------------------------------------
    def serves(self, model: str, version: str) -> bool:
        """Whether some accepting worker has this model version."""
        return self.workers.serving_count((model, version)) > 0

    def accepting(self, worker_id: str) -> bool:
        """Whether the worker takes batches from this router now."""
        slot = self.workers.get(worker_id)
        return slot is not None and slot.accepting

    def in_flight_on(self, worker_id: str) -> int:
        """Batches this router has in flight on a worker."""
        slot = self.workers.get(worker_id)
        return 0 if slot is None else slot.in_flight_batches
