"""The batch runner: one batch at a time per device, in arrival order across every router's stream.

Each accepted batch gets exactly one BatchResult with an outcome for every item, sent on the stream it
came from. Items are skipped (never executed) when the router cancelled them or their deadline budget ran
out before execution; an item cancelled while executing gets CANCELLED instead of its outputs. The
forward pass runs on one dedicated thread, so the event loop keeps reading streams meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.errors import Cancelled, Code, DeadlineExceeded, NotFound, SluiceError
from common.pb.sluice.v1 import worker_pb2
from common.tensors import from_wire, to_wire
from worker.executor import ExecItem, Executor, ItemOutcome, LoadedModel
from worker.metrics import WorkerMetrics

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


def _error(item_id: int, err: SluiceError) -> worker_pb2.ItemResult:
    return worker_pb2.ItemResult(
        item_id=item_id, error=worker_pb2.ItemError(code=int(err.code), message=err.message)
    )


class BatchRunner:
    """Executes queued batches sequentially and reports results and load."""

    def __init__(
        self,
        executor: Executor,
        models: dict[tuple[str, str], LoadedModel],
        metrics: WorkerMetrics,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._executor = executor
        self._models = models
        self._metrics = metrics
        self._now = now
        self._queue: asyncio.Queue[_Work] = asyncio.Queue()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")
        self._pending = 0
        self._queued_items = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy_spans: deque[tuple[float, float]] = deque()
        self._task: asyncio.Task[None] | None = None
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
        """Start executing in the background."""
        self._task = asyncio.create_task(self._run(), name="batch-runner")

    async def stop(self) -> None:
        """Stop the loop and the device thread."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

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

    async def _run(self) -> None:
        while True:
            work = await self._queue.get()
            try:
                result = await self._execute(work)
                work.stream.send(worker_pb2.WorkerMessage(result=result))
            finally:
                self._pending -= 1
                self._queued_items -= len(work.batch.items)
                self._metrics.queued_batches.set(self._pending)
                if self._pending == 0:
                    self._idle.set()

    async def _execute(self, work: _Work) -> worker_pb2.BatchResult:
        batch = work.batch
        result = worker_pb2.BatchResult(batch_id=batch.batch_id)
        model = self._models.get((batch.model, batch.version))
        if model is None:
            missing = NotFound(f"worker does not serve {batch.model} version {batch.version}")
            result.items.extend(_error(item.item_id, missing) for item in batch.items)
            return result
        start = self._now()
        runnable, skipped = self._select(work, start)
        outcomes: list[ItemOutcome] = []
        if runnable:
            outcomes = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._executor.run, model, runnable, list(batch.outputs)
            )
        end = self._now()
        result.items.extend(skipped)
        result.items.extend(self._encode(o, work.stream) for o in outcomes)
        result.executed_size = sum(_rows(item) for item in runnable)
        result.queue_us = round((start - work.received_at) * 1e6)
        result.execute_us = round((end - start) * 1e6)
        self._account(batch.model, work, result, start, end)
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
            return _error(outcome.item_id, outcome.error or SluiceError("no outputs"))
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


def _rows(item: ExecItem) -> int:
    first: Any = next(iter(item.inputs.values()), np.empty((0,)))
    return int(first.shape[0]) if first.ndim else 1


def _code_name(code: int) -> str:
    return Code(code).name if code in Code._value2member_map_ else str(code)
