"""The asyncio driver of the router core: translates events into core calls, carries decisions out.

It holds no policy and no copy of the core's state. What it owns is I/O and the shell's half of each
request: the caller's future, its trace span, the batch spans it opened (router/batch_spans.py), metrics.
Events arrive from the servicer (`infer`, a cancellation), from worker streams (`on_message`: answers and
load reports, and `worker_connected`), from membership (`worker_registered`, `worker_left`) and from the
peers' view (tenants, the peer routers and their demand, publish rounds); the loop only wakes the core at
the times it asks for. Every decision is carried out the same way: settle the requests (the future gets a
reply or the typed error), disconnect hung workers, and send each worker one stream message holding what
to drop and every batch the decision cut for it (packed: one buffer per input, router/batch_wire.py).

The loop never dies of a bug: a failing tick ends what the core held (INTERNAL) and the loop goes on; a
failing answer ends that batch's requests; the loop ticks at least every `TICK_S`, the watchdog's evidence
that it is alive (router/status.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from opentelemetry.trace import NoOpTracer, SpanContext, Tracer, get_current_span

from sluice_inference.common.clock import Alarm, Clock, wait_until
from sluice_inference.common.errors import Code, Internal, SluiceError, Unavailable
from sluice_inference.common.loop_metrics import CounterChild, HistogramChild
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.router.batch_spans import BatchSpans
from sluice_inference.router.batch_wire import core_answer, wire_batch
from sluice_inference.router.calls import Tensor
from sluice_inference.router.codec import DecodedRequest, ServedBy
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.demand import Demand
from sluice_inference.router.policy.lanes import LaneLimits, QueuedRequest
from sluice_inference.router.policy.outcomes import Decision, Dispatch, Served
from sluice_inference.router.policy.tenants import Tenant
from sluice_inference.router.worker_link import WorkerLinks

log = logging.getLogger(__name__)

TICK_S = 0.5
"""The decision loop runs at least this often, even with nothing to do: its heartbeat."""
SHUTDOWN_RETRY_S = 0.1


class ItemReply(NamedTuple):
    """The outputs of one request and how it was served (a tuple, like the other records made per
    request: a frozen dataclass costs several times as much to build)."""

    outputs: list[Tensor]
    served: ServedBy


@dataclass(frozen=True, slots=True)
class _BoundMetrics:
    """One model's metric children: models are the registered ones, so the set is bounded."""

    queue_wait: HistogramChild
    redispatched: CounterChild
    batch_size: HistogramChild
    batch_fill: HistogramChild
    execute: HistogramChild


class Waiter(NamedTuple):
    """The shell's half of a queued request (the core's opaque `payload`; a tuple: one per request)."""

    decoded: DecodedRequest
    future: asyncio.Future[ItemReply]
    span: SpanContext | None = None
    """The request's trace span, which the batch span links to."""


def _waiter(request: QueuedRequest) -> Waiter:
    assert isinstance(request.payload, Waiter)
    return request.payload


class Driver:
    """Runs one RouterCore under asyncio."""

    def __init__(
        self,
        clock: Clock,
        core: RouterCore,
        links: WorkerLinks,
        metrics: RouterMetrics,
        *,
        tracer: Tracer | None = None,
    ) -> None:
        self.clock = clock
        self.core = core
        self.watchdog_s = core.settings.watchdog_s
        self.last_tick = clock.now()
        """When the decision loop last ran (the watchdog's evidence that it is alive)."""
        self._links = links
        self._metrics = metrics
        self._tracing = tracer is not None
        """Whether requests carry spans to link batches to (no OpenTelemetry call per request if not)."""
        self._batch_spans = BatchSpans(tracer or NoOpTracer())
        self._bound: dict[str, _BoundMetrics] = {}
        self._alarm = Alarm(clock)
        self.arrivals = Alarm(clock)
        """Set by every request handed to the core: an idle router's status pass sleeps on it
        (router/status.py), so the first pass under new load, and the CPU pressure the batcher holds on,
        come with the load rather than up to `IDLE_REFRESH_S` later."""
        self._sleeping_until = float("inf")
        self._answered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the decision loop in the background."""
        self._task = asyncio.create_task(self._run(), name="router-driver")

    async def stop(self) -> None:
        """Stop the loop; queued and in-flight requests end UNAVAILABLE."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.abandon(Unavailable("router shutting down", reason="shutdown", retry_after_s=SHUTDOWN_RETRY_S))

    async def _run(self) -> None:
        while True:
            self._alarm.clear()
            # While the loop itself ticks it reads the wake time from the decision; the alarm is only for
            # events that arrive while it sleeps and need it sooner. (Comparing this tick's wake time with
            # the previous sleep's end, which lies a hair later, once made the loop spin until that time.)
            self._sleeping_until = -math.inf
            wake = self.tick()
            now = self.clock.now()
            until = now + TICK_S if wake is None else min(now + TICK_S, wake)
            self._sleeping_until = until
            await self._alarm.sleep_until(until)

    def tick(self) -> float | None:
        """One pass of the loop: tick the core now and carry the decision out; when to tick next."""
        now = self.last_tick = self.clock.now()
        try:
            decision = self.core.tick(now)
        except Exception as exc:  # the core is in an unknown state: end what it holds, go on
            log.exception("the decision loop failed; failing every request it holds")
            self.abandon(Internal(f"the router's scheduler failed ({type(exc).__name__})"))
            decision = Decision()
        self._carry_out(decision, now)
        return decision.wake_at

    def healthy(self, now: float) -> bool:
        """Whether the decision loop is running and ticked within `watchdog_s`."""
        running = self._task is not None and not self._task.done()
        return running and now - self.last_tick < self.watchdog_s

    def abandon(self, error: SluiceError) -> None:
        """End every queued and in-flight request with `error` (stuck or failed loop, shutdown)."""
        now = self.clock.now()
        self._carry_out(self.core.abandon(now, error), now)
        self._batch_spans.end_all(error.message)

    # -- requests -----------------------------------------------------------------------------------------
    async def infer(
        self, decoded: DecodedRequest, deadline: float, tenant: Tenant, priority: int, *, arrival: float
    ) -> ItemReply:
        """Hand a validated request to the core and wait for its outcome. `arrival` is when the call
        reached the router (decoding, idempotency and the cache ran since): admission judges the whole
        budget the client gave from it, so the router's own delays never make a refusal terminal."""
        now = self.clock.now()
        future: asyncio.Future[ItemReply] = asyncio.get_running_loop().create_future()
        span = get_current_span().get_span_context() if self._tracing else None
        request = self.core.new_request(
            min(arrival, now),
            lane=decoded.lane,
            rows=decoded.rows,
            deadline=deadline,
            payload=Waiter(decoded, future, span if span is not None and span.is_valid else None),
            tenant=tenant.name,
            priority=priority,
            limits=LaneLimits.of(decoded.record),
            weight=tenant.settings.weight,
            input_bytes=decoded.input_bytes,
            response_bytes=decoded.response_bytes,
            cost=decoded.cost,
        )
        self.arrivals.set()
        self._carry_out(self.core.arrive(now, request), now)
        if not future.done():
            metrics = self._metrics
            metrics.admitted(metrics.tenant_label(tenant.name), metrics.priority_label(priority)).inc()
        try:
            return await future
        except asyncio.CancelledError:
            now = self.clock.now()
            self._carry_out(self.core.cancel(now, request.request_id), now)
            raise
        except SluiceError:
            # The error's traceback holds this frame, and the frame the future that holds the error (and
            # the request, whose waiter holds it too): a reference cycle per refusal, ~50 objects left for
            # the cyclic collector, unless the frame lets go of both first.
            del future, request
            raise

    def charge(self, tenant: Tenant) -> None:
        """A request of `tenant` answered from the cache pays its rate (`RouterCore.charge`), or raises
        RESOURCE_EXHAUSTED."""
        self.core.charge(self.clock.now(), tenant.name)

    def host_load(self, *, batch_s: float, row_s: float, constrained: bool, pressure: float) -> None:
        """The router's own CPU per batch and per row, whether it is the constraint now, and its CPU
        pressure (`RouterCore.host_load`; the status pass measures them)."""
        now = self.clock.now()
        decision = self.core.host_load(
            now, batch_s=batch_s, row_s=row_s, constrained=constrained, pressure=pressure
        )
        self._carry_out(decision, now)

    # -- worker events ------------------------------------------------------------------------------------
    def on_message(self, worker_id: str, message: worker_pb2.WorkerMessage) -> None:
        """A message on a worker's stream: the answers to the batches of one forward, or a load report."""
        now = self.clock.now()
        for result in message.results:
            self._on_result(worker_id, result, now)
        if message.results:
            self._answered.set()
            self._answered = asyncio.Event()
        if message.HasField("load"):
            load = message.load
            ready = load.state == worker_pb2.WORKER_STATE_READY
            self._carry_out(self.core.worker_reported(now, worker_id, ready, load.queued_batches), now)

    def _on_result(self, worker_id: str, result: worker_pb2.BatchResult, now: float) -> None:
        self._batch_spans.end(result.batch_id)
        self._model_metrics(self._model_of(result.batch_id)).execute.observe(result.execute_us / 1e6)
        try:
            decision = self.core.answered(now, worker_id, core_answer(result))
        except Exception as exc:
            log.exception("handling the answer to batch %d failed", result.batch_id)
            error = Internal(f"the router failed on this request's answer ({type(exc).__name__})")
            decision = self.core.fail_batch(now, result.batch_id, error)
        self._carry_out(decision, now)

    def worker_registered(
        self,
        worker_id: str,
        models: dict[tuple[str, str], dict[int, float]],
        capacity: int,
        ready: bool,
        device: str,
    ) -> None:
        """A worker's etcd record appeared or changed (models with their warm-up timings)."""
        now = self.clock.now()
        self._carry_out(
            self.core.worker_registered(now, worker_id, models, capacity, ready, device=device), now
        )

    def worker_connected(self, worker_id: str, connected: bool) -> None:
        """A worker's stream came up or went down (its batches are then lost: `worker_left`)."""
        now = self.clock.now()
        self._carry_out(self.core.worker_connected(now, worker_id, connected), now)

    def set_tenants(self, tenants: dict[str, TenantSettings]) -> None:
        """Tenant quotas changed (config reload or etcd overrides)."""
        self.core.set_tenants(self.clock.now(), tenants)

    def set_peers(self, peers: Mapping[str, Demand] | None) -> None:
        """The other live routers and their published demand changed (None: unknown, etcd unreachable)."""
        self.core.set_peers(self.clock.now(), peers)

    def publish_demand(self) -> Demand | None:
        """A demand publish round: what to publish now, if anything (router/peers.py writes it)."""
        return self.core.publish_demand(self.clock.now())

    def count_published(self) -> None:
        """The demand last published has had time to reach every peer: count it in full."""
        self.core.count_published(self.clock.now())

    def demand_interval_s(self) -> float:
        """How long to wait between two demand publish rounds."""
        return self.core.publish_interval_s()

    def worker_left(self, worker_id: str, reason: str) -> None:
        """A worker is gone (deregistered or its stream broke)."""
        now = self.clock.now()
        self._batch_spans.end_worker(worker_id, f"worker lost: {reason}")
        self._carry_out(self.core.worker_left(now, worker_id, reason), now)
        self._answered.set()
        self._answered = asyncio.Event()

    async def wait_answered(self, worker_id: str, within_s: float) -> bool:
        """Wait until the worker holds no batch of ours (False if `within_s` passed first)."""
        give_up = self.clock.now() + within_s
        while self.core.in_flight_on(worker_id):
            if self.clock.now() >= give_up:
                return False
            answered = asyncio.ensure_future(self._answered.wait())
            if not await wait_until(self.clock, {answered}, give_up):
                answered.cancel()
        return True

    # -- carrying decisions out ----------------------------------------------------------------------------
    def _carry_out(self, decision: Decision, now: float) -> None:
        for settled in decision.settled:
            self._settle(settled.request, settled.outcome)
        outgoing: dict[str, worker_pb2.RouterMessage] = {}
        for worker_id, item_ids in decision.drops.items():
            outgoing[worker_id] = worker_pb2.RouterMessage(cancel=worker_pb2.Cancel(item_ids=item_ids))
        for worker_id in decision.lost:
            self._disconnect(worker_id)
        for learned in decision.learned:
            if learned.dispatch.expected_s > 0:
                model = learned.dispatch.lane.model
                self._metrics.estimate_error.labels(model).observe(
                    learned.seconds / learned.dispatch.expected_s - 1
                )
        sent: dict[str, list[Dispatch]] = {}
        for dispatch in decision.dispatches:
            if self._build(dispatch, now, outgoing):
                sent.setdefault(dispatch.worker_id, []).append(dispatch)
        for worker_id, message in outgoing.items():
            self._send(worker_id, message, sent.get(worker_id, []), now)
        if decision.wake_at is not None and decision.wake_at < self._sleeping_until:
            self._alarm.set()

    def _settle(self, request: QueuedRequest, outcome: Served | SluiceError) -> None:
        future = _waiter(request).future
        if future.done():
            return
        if isinstance(outcome, SluiceError):
            if outcome.reason == "shed":
                tenant, priority = request.tenant, request.priority
                self._metrics.shed.labels(
                    self._metrics.tenant_label(tenant), self._metrics.priority_label(priority)
                ).inc()
            elif outcome.code is Code.INTERNAL and outcome.__cause__ is not None:
                log.error("request %d failed in the router: %s", request.request_id, outcome.message,
                          exc_info=outcome.__cause__)  # fmt: skip
            future.set_exception(outcome)
        else:
            assert isinstance(outcome.outputs, list)
            served = ServedBy(outcome.worker_id, outcome.batch_rows, outcome.queue_s)
            future.set_result(ItemReply(outcome.outputs, served))

    def _build(self, dispatch: Dispatch, now: float, outgoing: dict[str, worker_pb2.RouterMessage]) -> bool:
        """Add the dispatch's batch to its worker's message of this decision (the batches one decision cuts
        for a worker travel in one stream message); False when it could not be built (it then fails)."""
        try:
            batch = self._batch(dispatch, now)
        except Exception as exc:  # a batch that cannot be built fails alone
            ids = [r.request_id for r in dispatch.requests]
            log.exception("building batch %d (requests %s) failed", dispatch.batch_id, ids)
            error = Internal(f"the router failed to send this request's batch ({type(exc).__name__})")
            self._batch_spans.end(dispatch.batch_id, error.message)
            self._carry_out(self.core.fail_batch(now, dispatch.batch_id, error), now)
            return False
        message = outgoing.get(dispatch.worker_id)
        if message is None:
            message = outgoing[dispatch.worker_id] = worker_pb2.RouterMessage()
        message.batches.append(batch)
        return True

    def _send(
        self, worker_id: str, message: worker_pb2.RouterMessage, batches: list[Dispatch], now: float
    ) -> None:
        """One stream message to a worker; its batches fail (alone) if it cannot be sent."""
        try:
            if self._links.send(worker_id, message):
                return
        except Exception as exc:
            log.exception("sending batches %s to %s failed", [d.batch_id for d in batches], worker_id)
            error = Internal(f"the router failed to send this request's batch ({type(exc).__name__})")
            for dispatch in batches:
                self._batch_spans.end(dispatch.batch_id, error.message)
                self._carry_out(self.core.fail_batch(now, dispatch.batch_id, error), now)
            return
        for dispatch in batches:
            self._batch_spans.end(dispatch.batch_id, "no open stream")
            self._carry_out(self.core.send_failed(now, dispatch.batch_id, "no open stream"), now)

    def _batch(self, dispatch: Dispatch, now: float) -> worker_pb2.Batch:
        """The wire batch (router/batch_wire.py), its metrics observed and its span opened."""
        model = dispatch.lane.model
        requests = dispatch.requests
        decoded = [_waiter(r).decoded for r in requests]
        batch = wire_batch(dispatch, decoded, now)
        metrics = self._model_metrics(model)
        for request in requests:
            metrics.queue_wait.observe(now - request.arrival)
        again = sum(1 for r in requests if r.attempts > 1)
        if again:
            metrics.redispatched.inc(again)
        metrics.batch_size.observe(dispatch.rows)
        metrics.batch_fill.observe(dispatch.rows / decoded[0].record.max_batch_size)
        if self._tracing:
            self._batch_spans.open(dispatch, batch, [_waiter(r).span for r in requests])
        return batch

    def _disconnect(self, worker_id: str) -> None:
        """A hung worker: close its stream (its registration, if still there, reconnects it later)."""
        log.error("worker %s holds batches and answered none for too long: treating it as lost", worker_id)
        self._batch_spans.end_worker(worker_id, "worker hung")
        link = self._links.get(worker_id)
        if link is not None:
            task = asyncio.create_task(link.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _model_metrics(self, model: str) -> _BoundMetrics:
        """The per-model metric children, bound once (a `labels()` lookup costs several µs per call)."""
        bound = self._bound.get(model)
        if bound is None:
            m = self._metrics
            bound = self._bound[model] = _BoundMetrics(
                m.queue_wait.labels(model), m.redispatched.labels(model), m.batch_size.labels(model),
                m.batch_fill.labels(model), m.execute.labels(model),
            )  # fmt: skip
        return bound

    def _model_of(self, batch_id: int) -> str:
        dispatch = self.core.view.dispatch(batch_id)
        return "unknown" if dispatch is None else dispatch.lane.model
