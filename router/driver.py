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
from common.telemetry import inject
from router.codec import DecodedRequest, ServedBy
from router.metrics import RouterMetrics
from router.policy.admission import AdmissionController, queue_bounds
from router.policy.batcher import AdaptiveBatcher, TimerBatcher
from router.policy.dispatcher import Decision, Dispatch, Dispatcher, Rejections
from router.policy.estimators import ServiceEstimates
from router.policy.lanes import LaneLimits, QueuedRequest
from router.policy.scheduler import make_chooser
from router.policy.tenants import Tenant
from router.worker_link import WorkerLinks

log = logging.getLogger(__name__)

# A worker that vanished mid-batch: the request can be retried at once on another worker.
WORKER_LOST_RETRY_S = 0.1


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
            batcher=AdaptiveBatcher() if settings.batcher == "adaptive" else TimerBatcher(),
            chooser=make_chooser(settings.scheduler),
            estimates=self.estimates,
            bounds=queue_bounds(admission),
            aging_s=admission.aging_s,
        )
        self.admission = AdmissionController(admission, tenants or {}, self.dispatcher, clock.now())
        self._links = links
        self._metrics = metrics
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dispatched_at: dict[int, float] = {}
        self._item_worker: dict[int, str] = {}

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the decision loop in the background."""
        self._task = asyncio.create_task(self._run(), name="router-driver")

    async def stop(self) -> None:
        """Stop the loop; queued and in-flight requests end UNAVAILABLE."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        shutting = Unavailable("router shutting down", reason="shutdown", retry_after_s=WORKER_LOST_RETRY_S)
        for lane in list(self.dispatcher.lanes.values()):
            for request in list(lane):
                self.dispatcher.cancel(request.request_id)
                _settle(request, shutting)
        for worker_id in {d.worker_id for d in self.dispatcher.in_flight.values()}:
            self._fail_batches(self.dispatcher.worker_left(worker_id), shutting)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            decision = self.dispatcher.poll(self.clock.now())
            self._carry_out(decision)
            timeout = None
            if decision.wake_at is not None:
                timeout = max(0.0, decision.wake_at - self.clock.now())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

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
            size_bytes=sum(len(t.data) for t in decoded.inputs),
            cost=decoded.cost,
        )
        limits = LaneLimits(record.max_batch_size, record.max_wait_s, record.max_batch_cost)
        self._settle_all(self.admission.admit(request, limits, now))
        self._metrics.admissions.labels(tenant.name, str(priority)).inc()
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(request.request_id)
            raise
        finally:
            self.admission.release(request)

    def _settle_all(self, rejected: Rejections) -> None:
        for request, error in rejected:
            if error.reason == "shed":
                self._metrics.shed.labels(request.tenant, str(request.priority)).inc()
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
        for dispatch in decision.dispatches:
            self._send(dispatch, now)
        self._metrics.queue_depth.set(self.dispatcher.queued())
        self._metrics.in_flight_batches.set(len(self.dispatcher.in_flight))

    def _send(self, dispatch: Dispatch, now: float) -> None:
        model = dispatch.lane.model
        batch = worker_pb2.Batch(batch_id=dispatch.batch_id, model=model, version=dispatch.lane.version)
        for request in dispatch.requests:
            budget_us = max(1, round((request.deadline - now) * 1e6))
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
            self.dispatcher.complete(dispatch.batch_id)
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
        """A worker answered a batch: learn from its timing, settle each of its requests."""
        now = self.clock.now()
        dispatch = self.dispatcher.complete(result.batch_id, now)
        self._wake.set()
        self._announce_answer()
        if dispatch is None:
            log.warning("worker %s answered unknown batch %d", worker_id, result.batch_id)
            return
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
        broken = bool(outcomes) and all(
            item.HasField("error") and item.error.code == Code.INTERNAL for item in outcomes.values()
        )
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
        limits = LaneLimits(record.max_batch_size, record.max_wait_s, record.max_batch_cost)
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
