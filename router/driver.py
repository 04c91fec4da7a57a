"""The asyncio driver of the policy core: feeds it events, carries out its decisions, sleeps until told.

Every request the driver accepts ends exactly once: its future gets a reply or a SluiceError, or the
caller cancels it (then it leaves the queue, or the worker is told to skip it). The Dispatcher decides;
this module only moves messages and resolves futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass

from opentelemetry.trace import (
    Link,
    NoOpTracer,
    Span,
    SpanContext,
    Status,
    StatusCode,
    Tracer,
    get_current_span,
)

from common.clock import Clock
from common.config import AdmissionSettings, RouterSettings, TenantSettings
from common.errors import Code, DeadlineExceeded, Internal, SluiceError, Unavailable, error_for_code
from common.pb.sluice.v1 import worker_pb2
from common.records import ModelRecord
from common.telemetry import inject
from router.codec import DecodedRequest, ServedBy
from router.metrics import RouterMetrics
from router.policy.admission import AdmissionController, queue_bounds
from router.policy.batcher import AdaptiveBatcher, Batcher, TimerBatcher
from router.policy.dispatcher import Decision, Dispatch, Dispatcher, Rejections
from router.policy.estimators import ServiceEstimates
from router.policy.lanes import LaneLimits, QueuedRequest
from router.policy.scheduler import make_chooser
from router.policy.tenants import Tenant
from router.worker_link import WorkerLinks

log = logging.getLogger(__name__)

# A worker that vanished mid-batch: the request can be retried at once on another worker.
WORKER_LOST_RETRY_S = 0.1
TICK_S = 0.5
"""The decision loop runs at least this often, even with nothing to do: its heartbeat."""
MAX_BUDGET_US = 2**63 - 1
"""An item's budget is an int64 on the wire."""
ITEM_OVERHEAD_BYTES = 256
"""Framing of one item on the worker stream (ids, names, shapes), counted in a batch's size."""


@dataclass(frozen=True)
class ItemReply:
    """The outputs of one request and how it was served."""

    outputs: list[worker_pb2.Tensor]
    served: ServedBy


@dataclass(frozen=True)
class Pending:
    """The shell's part of a queued request (the core's `payload`)."""

    decoded: DecodedRequest
    future: asyncio.Future[ItemReply]
    span: SpanContext | None = None
    """The request's trace span, which the batch span links to."""


def _pending(request: QueuedRequest) -> Pending:
    assert isinstance(request.payload, Pending)
    return request.payload


def _settle(request: QueuedRequest, outcome: ItemReply | SluiceError) -> None:
    future = _pending(request).future
    if future.done():
        return
    if isinstance(outcome, SluiceError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class Alarm:
    """What the decision loop sleeps on: `sleep(timeout)` returns when `set()` was called since the last
    `clear()`, or once `seconds` pass. Unlike `asyncio.wait_for(event.wait(), timeout)` on Python 3.11 it
    never swallows a cancellation that arrives just as it is woken (which once left a router's stop
    waiting forever), and it costs one future per sleep instead of a task."""

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        """Wake the sleeper now, or make its next sleep return at once."""
        self._set = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def clear(self) -> None:
        """Forget earlier `set` calls."""
        self._set = False

    async def sleep(self, seconds: float) -> None:
        """Until set, or `seconds` have passed."""
        if self._set:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        alarm = loop.call_later(seconds, _ring, waiter)
        try:
            await waiter
        finally:
            alarm.cancel()
            self._waiter = None


def _ring(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Driver:
    """Owns the admission controller, the Dispatcher and the loop that runs them."""

    def __init__(
        self,
        clock: Clock,
        links: WorkerLinks,
        metrics: RouterMetrics,
        *,
        admission: AdmissionSettings | None = None,
        tenants: dict[str, TenantSettings] | None = None,
        settings: RouterSettings | None = None,
        max_batch_bytes: int | None = None,
        batcher: Batcher | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.clock = clock
        self._tracer = tracer or NoOpTracer()
        self._batch_spans: dict[int, Span] = {}
        self._predicted: dict[int, float] = {}
        self._answered = asyncio.Event()
        self._last_answer: dict[str, float] = {}
        admission = admission or AdmissionSettings()
        settings = settings or RouterSettings()
        self.estimates = ServiceEstimates()
        self.dispatcher = Dispatcher(
            batcher=batcher or (AdaptiveBatcher() if settings.batcher == "adaptive" else TimerBatcher()),
            chooser=make_chooser(settings.scheduler),
            estimates=self.estimates,
            bounds=queue_bounds(admission),
            aging_s=admission.aging_s,
            hang_after_s=settings.worker_hang_s,
        )
        self.admission = AdmissionController(admission, tenants or {}, self.dispatcher, clock.now())
        self.watchdog_s = settings.watchdog_s
        self.last_tick = clock.now()
        """When the decision loop last ran (the watchdog's evidence that it is alive)."""
        self._max_batch_bytes = max_batch_bytes
        self._links = links
        self._metrics = metrics
        self._ids = itertools.count(1)
        self._wake = Alarm()
        self._task: asyncio.Task[None] | None = None
        self._dispatched_at: dict[int, float] = {}
        self._item_worker: dict[int, str] = {}
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
        self.abandon(
            Unavailable("router shutting down", reason="shutdown", retry_after_s=WORKER_LOST_RETRY_S)
        )

    async def _run(self) -> None:
        """Poll, carry out, sleep until the wake-up time or the next event — and never die of a bug: a
        failing decision fails the requests it concerns, and the loop ticks at least every `TICK_S` so the
        watchdog can tell a live loop from a stuck one."""
        while True:
            self._wake.clear()
            now = self.last_tick = self.clock.now()
            try:
                decision = self.dispatcher.poll(now)
            except Exception as exc:  # the core is in an unknown state: fail what it holds, go on
                log.exception("the decision loop failed; failing every request it holds")
                self.abandon(Internal(f"the router's scheduler failed ({type(exc).__name__})"))
                decision = Decision()
            self._carry_out(decision)
            timeout = TICK_S
            if decision.wake_at is not None:
                timeout = min(TICK_S, max(0.0, decision.wake_at - self.clock.now()))
            await self._wake.sleep(timeout)

    def healthy(self, now: float) -> bool:
        """Whether the decision loop is running and ticked within `watchdog_s`."""
        running = self._task is not None and not self._task.done()
        return running and now - self.last_tick < self.watchdog_s

    def abandon(self, error: SluiceError) -> None:
        """End every queued and in-flight request with `error` (a stuck or failed core, or shutdown)."""
        for lane in list(self.dispatcher.lanes.values()):
            for request in list(lane):
                self.dispatcher.cancel(request.request_id)
                _settle(request, error)
        for worker_id in {d.worker_id for d in self.dispatcher.in_flight.values()}:
            self._fail_batches(self.dispatcher.worker_left(worker_id), error)

    # -- requests -----------------------------------------------------------------------------------------
    async def infer(
        self, decoded: DecodedRequest, deadline: float, tenant: Tenant, priority: int
    ) -> ItemReply:
        """Admit a validated request, queue it and wait for its outcome."""
        now = self.clock.now()
        record = decoded.record
        if deadline <= now:
            raise DeadlineExceeded("deadline already passed on arrival", reason="expired_on_arrival")
        if not self.dispatcher.serves(record.name, record.version):
            raise Unavailable(
                f"no ready worker serves {record.name} version {record.version}",
                reason="no_worker",
                retry_after_s=1.0,
            )
        future: asyncio.Future[ItemReply] = asyncio.get_running_loop().create_future()
        span = get_current_span().get_span_context()
        request = QueuedRequest(
            next(self._ids),
            decoded.lane,
            decoded.rows,
            now,
            deadline,
            Pending(decoded, future, span if span.is_valid else None),
            tenant=tenant.name,
            priority=priority,
            weight=tenant.settings.weight,
            size_bytes=decoded.input_bytes,
            cost=decoded.cost,
            wire_bytes=decoded.input_bytes + decoded.response_bytes + ITEM_OVERHEAD_BYTES,
        )
        limits = self._limits(record)
        self._settle_all(self.admission.admit(request, limits, now))
        self._metrics.admissions.labels(
            self._metrics.tenant_label(tenant.name), self._metrics.priority_label(priority)
        ).inc()
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(request.request_id)
            raise
        finally:
            self.admission.release(request)

    def _limits(self, record: ModelRecord) -> LaneLimits:
        return LaneLimits(
            record.max_batch_size, record.max_wait_s, record.max_batch_cost, self._max_batch_bytes
        )

    def _settle_all(self, rejected: Rejections) -> None:
        for request, error in rejected:
            if error.reason == "shed":
                self._metrics.shed.labels(
                    self._metrics.tenant_label(request.tenant), self._metrics.priority_label(request.priority)
                ).inc()
            elif error.code is Code.INTERNAL:
                log.error("request %d failed in the router: %s", request.request_id, error.message,
                          exc_info=error.__cause__)  # fmt: skip
            _settle(request, error)

    def _cancel(self, request_id: int) -> None:
        if self.dispatcher.cancel(request_id) is not None:
            return
        worker_id = self._item_worker.pop(request_id, None)
        if worker_id is not None:
            cancel = worker_pb2.RouterMessage(cancel=worker_pb2.Cancel(item_ids=[request_id]))
            self._links.send(worker_id, cancel)

    # -- decisions ----------------------------------------------------------------------------------------
    def _carry_out(self, decision: Decision) -> None:
        self._settle_all(decision.rejected)
        now = self.clock.now()
        self._end_overdue(decision.overdue)
        for worker_id in decision.hung:
            self._hung(worker_id)
        for dispatch in decision.dispatches:
            try:
                self._send(dispatch, now)
            except Exception as exc:  # a batch that cannot be built or sent fails alone
                ids = [r.request_id for r in dispatch.requests]
                log.exception("sending batch %d (requests %s) failed", dispatch.batch_id, ids)
                self.dispatcher.complete(dispatch.batch_id, now)
                self._fail_batches([dispatch], Internal(f"the router failed to send this request's batch "
                                                        f"({type(exc).__name__})"))  # fmt: skip
        self._metrics.queue_depth.set(self.dispatcher.queued())
        self._metrics.in_flight_batches.set(len(self.dispatcher.in_flight))

    def _end_overdue(self, overdue: list[tuple[QueuedRequest, str]]) -> None:
        """Dispatched requests past their deadline end now; their workers are told to drop them."""
        dropped: dict[str, list[int]] = {}
        for request, worker_id in overdue:
            _settle(request, DeadlineExceeded("deadline passed before the worker answered",
                                              reason="expired_on_worker"))  # fmt: skip
            dropped.setdefault(worker_id, []).append(request.request_id)
        for worker_id, item_ids in dropped.items():
            cancel = worker_pb2.RouterMessage(cancel=worker_pb2.Cancel(item_ids=item_ids))
            self._links.send(worker_id, cancel)

    def _hung(self, worker_id: str) -> None:
        """A worker holding work made no progress for too long: treat it as lost and close its stream (its
        registration, if still there, reconnects it later; the breaker remembers)."""
        log.error("worker %s holds batches and answered none for too long: treating it as lost", worker_id)
        self.worker_lost(worker_id, "hung: no progress while holding batches")
        link = self._links.get(worker_id)
        if link is not None:
            task = asyncio.create_task(link.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _send(self, dispatch: Dispatch, now: float) -> None:
        model = dispatch.lane.model
        batch = worker_pb2.Batch(batch_id=dispatch.batch_id, model=model, version=dispatch.lane.version)
        for request in dispatch.requests:
            budget_us = min(MAX_BUDGET_US, max(1, round((request.deadline - now) * 1e6)))
            batch.items.add(
                item_id=request.request_id, inputs=_pending(request).decoded.inputs, budget_us=budget_us
            )
            self._item_worker[request.request_id] = dispatch.worker_id
            self._metrics.queue_wait.labels(model).observe(now - request.arrival)
        self._metrics.batch_size.labels(model).observe(dispatch.rows)
        record = _pending(dispatch.requests[0]).decoded.record
        self._metrics.batch_fill.labels(model).observe(dispatch.rows / record.max_batch_size)
        self._predicted[dispatch.batch_id] = self.estimates.batch_seconds(
            model, dispatch.lane.version, dispatch.rows, dispatch.worker_id, dispatch.lane.shape
        )
        self._dispatched_at[dispatch.batch_id] = now
        self._trace_batch(dispatch, batch)
        if not self._links.send(dispatch.worker_id, worker_pb2.RouterMessage(batch=batch)):
            self.dispatcher.complete(dispatch.batch_id, now)
            self._fail_batches([dispatch], _worker_lost(dispatch.worker_id, "no open stream"))

    def _trace_batch(self, dispatch: Dispatch, batch: worker_pb2.Batch) -> None:
        """Open the batch span, linked to every request it carries; the worker's span becomes its child."""
        links = [Link(p.span) for r in dispatch.requests if (p := _pending(r)).span is not None]
        if not links:
            return
        span = self._tracer.start_span(
            "sluice.batch",
            links=links,
            attributes={
                "sluice.model": dispatch.lane.model,
                "sluice.version": dispatch.lane.version,
                "sluice.batch_rows": dispatch.rows,
                "sluice.worker": dispatch.worker_id,
                "sluice.cut_reason": dispatch.reason,
            },
        )
        batch.trace_context.update(inject(span))
        self._batch_spans[dispatch.batch_id] = span

    def _end_batch_span(self, batch_id: int, error: str = "") -> None:
        span = self._batch_spans.pop(batch_id, None)
        if span is not None:
            if error:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()

    # -- worker events ------------------------------------------------------------------------------------
    def on_result(self, worker_id: str, result: worker_pb2.BatchResult) -> None:
        """A worker answered a batch: learn from its timing, settle each of its requests. A bug while
        handling the answer fails that batch's requests, nothing else."""
        now = self.clock.now()
        dispatch = self.dispatcher.complete(result.batch_id, now)
        self._wake.set()
        self._announce_answer()
        if dispatch is None:
            log.warning("worker %s answered unknown batch %d", worker_id, result.batch_id)
            return
        try:
            self._answered_batch(worker_id, dispatch, result, now)
        except Exception as exc:
            ids = [r.request_id for r in dispatch.requests]
            log.exception("handling the answer to batch %d (requests %s) failed", dispatch.batch_id, ids)
            self._fail_batches([dispatch], Internal(f"the router failed on this request's answer "
                                                    f"({type(exc).__name__})"))  # fmt: skip

    def _answered_batch(
        self, worker_id: str, dispatch: Dispatch, result: worker_pb2.BatchResult, now: float
    ) -> None:
        sent_at = self._dispatched_at.pop(dispatch.batch_id, now)
        self._end_batch_span(dispatch.batch_id)
        key = dispatch.lane
        self._metrics.execute.labels(key.model).observe(result.execute_us / 1e6)
        predicted = self._predicted.pop(dispatch.batch_id, 0.0)
        previous_answer = self._last_answer.get(worker_id, 0.0)
        self._last_answer[worker_id] = now
        if result.executed_size:
            # What the batch cost as the router sees the worker: from when the worker could start it (sent
            # to an idle worker, or its previous answer) to this answer. Besides the forward pass this
            # includes the worker's host work and both hops, which decide how soon it can take the next
            # batch (the forward alone made a fast model look free, so batches stayed tiny).
            seconds = max(result.execute_us / 1e6, now - max(sent_at, previous_answer))
            if predicted > 0 and result.executed_size == dispatch.rows:
                self._metrics.estimate_error.labels(key.model).observe(seconds / predicted - 1.0)
            self.estimates.observe(
                key.model, key.version, result.executed_size, seconds, worker_id, shape=key.shape
            )
        outcomes = {item.item_id: item for item in result.items}
        # Only failures the worker blames on itself count against it: a batch of bad items (the client's
        # fault, proven by the worker's canary) must not take a healthy worker out of rotation.
        broken = any(item.HasField("error") and item.error.worker_fault for item in outcomes.values())
        if broken:
            self.dispatcher.breaker.failure(worker_id, now)
        else:
            self.dispatcher.breaker.success(worker_id)
        for request in dispatch.requests:
            self._item_worker.pop(request.request_id, None)
            self._settle_result(
                request,
                outcomes.get(request.request_id),
                worker_id=worker_id,
                dispatch=dispatch,
                sent_at=sent_at,
                now=now,
            )

    def _settle_result(
        self,
        request: QueuedRequest,
        item: worker_pb2.ItemResult | None,
        *,
        worker_id: str,
        dispatch: Dispatch,
        sent_at: float,
        now: float,
    ) -> None:
        if item is None:
            _settle(request, Internal(f"worker {worker_id} returned no outcome for this request"))
        elif item.HasField("error"):
            _settle(request, error_for_code(item.error.code, item.error.message, reason="worker_error"))
        elif now > request.deadline:
            _settle(request, DeadlineExceeded("finished after its deadline", reason="finished_late"))
        else:
            self.dispatcher.finished(request, now)
            _settle(
                request,
                ItemReply(list(item.outputs), ServedBy(worker_id, dispatch.rows, sent_at - request.arrival)),
            )

    def worker_joined(self, worker_id: str, models: set[tuple[str, str]], capacity: int) -> None:
        """A worker is known (accepting only once `worker_accepting(True)`)."""
        self.dispatcher.worker_joined(worker_id, models, capacity)
        self.dispatcher.worker_accepting(worker_id, False)

    def worker_accepting(self, worker_id: str, accepting: bool) -> None:
        """Open or close a worker to new batches."""
        self.dispatcher.worker_accepting(worker_id, accepting)
        self._wake.set()

    def worker_lost(self, worker_id: str, reason: str) -> None:
        """A worker's stream is gone. Its in-flight requests are dispatched once more elsewhere if their
        deadlines still allow; the others end UNAVAILABLE (retryable, short hint) — never silence."""
        now = self.clock.now()
        lost = self.dispatcher.worker_left(worker_id)
        if lost:
            self.dispatcher.breaker.failure(worker_id, now)
        error = _worker_lost(worker_id, reason)
        for dispatch in lost:
            self._dispatched_at.pop(dispatch.batch_id, None)
            self._predicted.pop(dispatch.batch_id, None)
            self._end_batch_span(dispatch.batch_id, f"worker lost: {reason}")
            for request in dispatch.requests:
                self._item_worker.pop(request.request_id, None)
                self._redispatch_or_fail(request, error, now)
        self._announce_answer()
        self._wake.set()

    def _redispatch_or_fail(self, request: QueuedRequest, error: SluiceError, now: float) -> None:
        record = _pending(request).decoded.record
        if request.attempts > 1 or now >= request.latest_start or _pending(request).future.done():
            _settle(request, error)
            return
        limits = self._limits(record)
        try:
            self._settle_all(self.dispatcher.resubmit(request, limits))
            self._metrics.redispatched.labels(record.name).inc()
        except SluiceError as refused:
            _settle(request, refused)

    def in_flight_on(self, worker_id: str) -> int:
        """Batches this router has in flight on a worker."""
        slot = self.dispatcher.workers.get(worker_id)
        return 0 if slot is None else slot.in_flight_batches

    async def wait_answered(self, worker_id: str, within_s: float) -> bool:
        """Wait until the worker holds no batch of ours (False if `within_s` passed first)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + within_s
        while self.in_flight_on(worker_id):
            remaining = give_up - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._answered.wait(), remaining)
        return True

    def _announce_answer(self) -> None:
        """Wake `wait_answered` callers: set this generation's event and start a new one."""
        self._answered.set()
        self._answered = asyncio.Event()

    def _fail_batches(self, batches: list[Dispatch], error: SluiceError) -> None:
        for dispatch in batches:
            self._dispatched_at.pop(dispatch.batch_id, None)
            self._predicted.pop(dispatch.batch_id, None)
            self._end_batch_span(dispatch.batch_id, error.message)
            for request in dispatch.requests:
                self._item_worker.pop(request.request_id, None)
                _settle(request, error)


def _worker_lost(worker_id: str, reason: str) -> Unavailable:
    return Unavailable(
        f"worker {worker_id} was lost before answering ({reason})",
        reason="worker_lost",
        retry_after_s=WORKER_LOST_RETRY_S,
    )
