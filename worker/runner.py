"""The batch runner: one batch at a time per device, in arrival order across every router's stream.

Each accepted batch gets exactly one BatchResult with an outcome for every item, sent on the stream it
came from. Items are skipped (never executed) when the router cancelled them or their deadline budget ran
out before staging; an item cancelled while executing gets CANCELLED instead of its outputs. Each item
error says whether the worker is to blame (`ItemError.worker_fault`: the executor's blame, a worker bug,
a model this worker does not serve) or not (the item's own fault, a cancellation, a deadline).

One exception: a device fault (worker/faults.py). The batch that met it is answered (its items blamed on
the worker), `on_device_fault` is called once, and every batch not yet run is dropped unanswered, never
touching the device again: the worker is leaving, its streams close, and routers treat those items as
lost with the worker (re-dispatched elsewhere) — the item that broke the device was in the answered batch.

Two stages on two threads, so the event loop keeps reading streams and the device never waits for host
work: the staging thread decodes, validates, concatenates and starts the copy to the device of batch N+1
while the device thread runs the forward of batch N, and any re-run of it (bisection, the canary). At most
one staged batch waits for the device.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry.trace import NoOpTracer, Tracer

from common.errors import Cancelled, Code, DeadlineExceeded, Internal, NotFound, SluiceError
from common.pb.sluice.v1 import worker_pb2
from common.telemetry import extract_mapping
from common.tensors import from_wire, to_wire
from worker.executor import ExecItem, Executor, ItemOutcome, LoadedModel, PreparedBatch
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

BUSY_WINDOW_S = 5.0


@dataclass(eq=False)
class StreamState:
    """One router's stream: where its results go and which of its items were cancelled."""

    outbox: asyncio.Queue[worker_pb2.WorkerMessage | None] = field(default_factory=asyncio.Queue)
    cancelled: set[int] = field(default_factory=set)
    open: bool = True

    def send(self, message: worker_pb2.WorkerMessage) -> None:
        """Queue a message for the router (dropped if the stream is gone: nobody is listening)."""
        if self.open:
            self.outbox.put_nowait(message)


@dataclass
class _Work:
    batch: worker_pb2.Batch
    stream: StreamState
    received_at: float


@dataclass
class _Ready:
    """A batch after staging: items skipped before staging, and what the device must run."""

    work: _Work
    skipped: list[worker_pb2.ItemResult]
    runnable: list[ExecItem]
    prepared: PreparedBatch | None


def _error(item_id: int, err: SluiceError, *, worker_fault: bool = False) -> worker_pb2.ItemResult:
    error = worker_pb2.ItemError(code=int(err.code), message=err.message, worker_fault=worker_fault)
    return worker_pb2.ItemResult(item_id=item_id, error=error)


class BatchRunner:
    """Executes queued batches sequentially and reports results and load."""

    def __init__(
        self,
        executor: Executor,
        models: dict[tuple[str, str], LoadedModel],
        metrics: WorkerMetrics,
        *,
        now: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
        on_device_fault: Callable[[Internal], None] | None = None,
    ) -> None:
        self._executor = executor
        self._on_device_fault = on_device_fault
        self._tracer = tracer or NoOpTracer()
        self._models = models
        self._metrics = metrics
        self._now = now
        self._queue: asyncio.Queue[_Work] = asyncio.Queue()
        self._ready: asyncio.Queue[_Ready] = asyncio.Queue(maxsize=1)
        self._staging = ThreadPoolExecutor(max_workers=1, thread_name_prefix="staging")
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
        self._pending = 0
        self._queued_items = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy_spans: deque[tuple[float, float]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self.batches_executed = 0
        self.items_executed = 0

    @property
    def pending_batches(self) -> int:
        """Batches accepted and not yet answered (the executing one included)."""
        return self._pending

    @property
    def queued_items(self) -> int:
        """Items in batches accepted and not yet answered."""
        return self._queued_items

    def start(self) -> None:
        """Start staging and executing in the background."""
        self._tasks = [
            asyncio.create_task(self._stage_loop(), name="batch-staging"),
            asyncio.create_task(self._execute_loop(), name="batch-execution"),
        ]

    async def stop(self) -> None:
        """Stop both loops and their threads."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._staging.shutdown(wait=True, cancel_futures=True)
        self._device.shutdown(wait=True, cancel_futures=True)

    def submit(self, batch: worker_pb2.Batch, stream: StreamState) -> None:
        """Accept a batch for execution."""
        self._pending += 1
        self._queued_items += len(batch.items)
        self._idle.clear()
        self._metrics.queued_batches.set(self._pending)
        self._queue.put_nowait(_Work(batch, stream, self._now()))

    async def wait_idle(self, within_s: float) -> bool:
        """Wait until no batch is queued or executing (False on timeout)."""
        try:
            await asyncio.wait_for(self._idle.wait(), within_s)
        except TimeoutError:
            return False
        return True

    def busy_fraction(self) -> float:
        """Share of the last BUSY_WINDOW_S spent executing."""
        now = self._now()
        horizon = now - BUSY_WINDOW_S
        while self._busy_spans and self._busy_spans[0][1] < horizon:
            self._busy_spans.popleft()
        busy = sum(end - max(start, horizon) for start, end in self._busy_spans)
        return min(1.0, busy / BUSY_WINDOW_S)

    async def _stage_loop(self) -> None:
        while True:
            work = await self._queue.get()
            try:
                ready = await self._stage(work)
            except Exception as exc:  # a bug must fail this batch's items, not stop the worker
                log.exception("staging batch %d failed", work.batch.batch_id)
                ready = _Ready(work, _fail_all(work.batch, exc), [], None)
            await self._ready.put(ready)

    async def _execute_loop(self) -> None:
        while True:
            ready = await self._ready.get()
            try:
                if self._executor.fault is None:  # else dropped unanswered (module docstring)
                    await self._answer(ready)
            finally:
                self._pending -= 1
                self._queued_items -= len(ready.work.batch.items)
                self._metrics.queued_batches.set(self._pending)
                if self._pending == 0:
                    self._idle.set()

    async def _answer(self, ready: _Ready) -> None:
        """Execute one batch, send its result, and report a device fault it met (once: later batches are
        dropped)."""
        try:
            result = await self._execute(ready)
        except Exception as exc:  # a bug must fail this batch's items, not stop the worker
            log.exception("executing batch %d failed", ready.work.batch.batch_id)
            result = worker_pb2.BatchResult(batch_id=ready.work.batch.batch_id)
            result.items.extend(_fail_all(ready.work.batch, exc))
        ready.work.stream.send(worker_pb2.WorkerMessage(result=result))
        fault = self._executor.fault
        if fault is not None and self._on_device_fault is not None:
            self._on_device_fault(fault)

    async def _stage(self, work: _Work) -> _Ready:
        batch = work.batch
        if self._executor.fault is not None:  # will be dropped: the device must not be touched again
            return _Ready(work, [], [], None)
        model = self._models.get((batch.model, batch.version))
        if model is None:
            # The router believed this worker serves it: the item is not to blame.
            missing = NotFound(f"worker does not serve {batch.model} version {batch.version}")
            skipped = [_error(item.item_id, missing, worker_fault=True) for item in batch.items]
            return _Ready(work, skipped, [], None)
        runnable, skipped = self._select(work, self._now())
        prepared = None
        if runnable:
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(
                self._staging, self._executor.prepare, model, runnable, list(batch.outputs)
            )
        return _Ready(work, skipped, runnable, prepared)

    async def _execute(self, ready: _Ready) -> worker_pb2.BatchResult:
        work = ready.work
        result = worker_pb2.BatchResult(batch_id=work.batch.batch_id)
        start = self._now()
        outcomes: list[ItemOutcome] = []
        span = self._tracer.start_span(
            "sluice.execute",
            context=extract_mapping(work.batch.trace_context),
            attributes={
                "sluice.model": work.batch.model,
                "sluice.version": work.batch.version,
                "sluice.items": len(work.batch.items),
            },
        )
        try:
            if ready.prepared is not None:
                loop = asyncio.get_running_loop()
                outcomes = await loop.run_in_executor(self._device, self._executor.execute, ready.prepared)
        finally:
            span.set_attribute("sluice.rows", sum(_rows(item) for item in ready.runnable))
            span.end()
        end = self._now()
        result.items.extend(ready.skipped)
        result.items.extend(self._encode(o, work.stream) for o in outcomes)
        result.executed_size = sum(_rows(item) for item in ready.runnable)
        result.queue_us = round((start - work.received_at) * 1e6)
        result.execute_us = round((end - start) * 1e6)
        self._account(work.batch.model, work, result, start, end)
        return result

    def _select(self, work: _Work, now: float) -> tuple[list[ExecItem], list[worker_pb2.ItemResult]]:
        runnable: list[ExecItem] = []
        skipped: list[worker_pb2.ItemResult] = []
        for item in work.batch.items:
            if item.item_id in work.stream.cancelled or not work.stream.open:
                work.stream.cancelled.discard(item.item_id)
                skipped.append(_error(item.item_id, Cancelled("cancelled by the router")))
            elif item.budget_us and work.received_at + item.budget_us / 1e6 <= now:
                skipped.append(_error(item.item_id, DeadlineExceeded("deadline passed before execution")))
            else:
                try:
                    inputs = {t.name: from_wire(t) for t in item.inputs}
                except SluiceError as err:
                    skipped.append(_error(item.item_id, err))
                    continue
                runnable.append(ExecItem(item.item_id, inputs))
        return runnable, skipped

    @staticmethod
    def _encode(outcome: ItemOutcome, stream: StreamState) -> worker_pb2.ItemResult:
        if outcome.item_id in stream.cancelled:
            stream.cancelled.discard(outcome.item_id)
            return _error(outcome.item_id, Cancelled("cancelled by the router during execution"))
        if outcome.error is not None or outcome.outputs is None:
            error = outcome.error or SluiceError("no outputs")
            return _error(outcome.item_id, error, worker_fault=outcome.worker_fault)
        tensors = [to_wire(name, array) for name, array in outcome.outputs.items()]
        return worker_pb2.ItemResult(item_id=outcome.item_id, outputs=tensors)

    def _account(
        self, model: str, work: _Work, result: worker_pb2.BatchResult, start: float, end: float
    ) -> None:
        self._busy_spans.append((start, end))
        self.batches_executed += 1
        self.items_executed += result.executed_size
        m = self._metrics
        m.batches.labels(model).inc()
        m.batch_size.labels(model).observe(result.executed_size)
        m.execute.labels(model).observe(end - start)
        m.queue_wait.labels(model).observe(start - work.received_at)
        for item in result.items:
            code = item.error.code if item.HasField("error") else 0
            m.items.labels(model, _code_name(code)).inc()
        m.busy_ratio.set(self.busy_fraction())


def _fail_all(batch: worker_pb2.Batch, exc: Exception) -> list[worker_pb2.ItemResult]:
    error = Internal(f"worker failed on this batch: {type(exc).__name__}: {exc}", reason="worker_bug")
    return [_error(item.item_id, error, worker_fault=True) for item in batch.items]


def _rows(item: ExecItem) -> int:
    first: Any = next(iter(item.inputs.values()), np.empty((0,)))
    return int(first.shape[0]) if first.ndim else 1


def _code_name(code: int) -> str:
    return Code(code).name if code in Code._value2member_map_ else str(code)
