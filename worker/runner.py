"""The batch runner: the device's queue across every router's stream, merged forwards, one answer per batch.

Ownership and threads: this class lives on the event loop: it accepts batches, keeps the queue's counts
and sends answers. One device thread (worker/device_thread.py) does all the rest, so the device never
waits for the loop and the loop is woken once per forward.
- `submit` accepts a batch, or refuses it at once when the worker already holds `capacity` batches (all
  routers' streams together): every item UNAVAILABLE with reason "worker_busy", never executed, not the
  worker's fault, so the router places it elsewhere.
- The device thread, whenever the device is free, runs the oldest waiting batch merged with the waiting
  batches of the same model, version, outputs and padded shape that fit (worker/merging.py; from any
  stream; nothing waits for a merge partner), and hands the answers of every batch in that forward back
  with one `call_soon_threadsafe`.
- `_finish` (on the loop) encodes each batch's outcomes and sends its BatchResult on the stream it came
  from, with the queue left behind it (`queued_batches`, `queued_rows`) and the forward's rows
  (`forward_rows`).

Why staging no longer runs ahead on a second thread: the next forward can only be formed when the device
is free (that is when the batches waiting for it are known), and staging ahead would fix its members one
forward early, so a batch arriving mid-forward would wait two forwards instead of one. Staging is small
next to a forward (docs/architecture.md has the figures), and one thread also means one loop wake-up per
forward instead of two per batch.

Each accepted batch gets exactly one BatchResult with an outcome for every item. Items are skipped (never
executed) when the router cancelled them or their deadline budget ran out before their forward started;
an item cancelled while executing gets CANCELLED instead of its outputs. Items of merged batches are
isolated and blamed as one batch's are (worker/executor.py): an item that fails alone fails alone, whichever
stream it came from, and one that succeeds proves the model works for all of them. Each item error says
whether the worker is to blame (`ItemError.worker_fault`) and why (`ItemError.reason`).

One exception: a device fault (worker/faults.py). The batches of the forward that met it are answered
(their items blamed on the worker), `on_device_fault` is called once, and every batch not yet run is
dropped unanswered, never touching the device again: the worker is leaving, its streams close, and
routers treat those items as lost with the worker (re-dispatched elsewhere).

Shared state: the device thread only reads a stream's `cancelled` set and `open` flag; only the loop
writes them (worker/device_thread.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from opentelemetry.trace import NoOpTracer, Tracer

from sluice_inference.common.errors import Cancelled, Code, Internal, SluiceError, Unavailable
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.tensors import to_wire
from sluice_inference.worker.busy import BusyWindow
from sluice_inference.worker.device_thread import Answer, DeviceThread, Forward, Work, fail_all
from sluice_inference.worker.executor import Executor, ItemOutcome, LoadedModel
from sluice_inference.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

BUSY_WINDOW_S = 5.0
BUSY_SLOTS = 20
"""busy_fraction covers the last 5 s to within one 0.25 s slot (worker/busy.py)."""
WORKER_BUSY = "worker_busy"
_MAX_ITEM_ROWS = 1 << 16  # a router's claimed rows per item, as counted in queued_rows (bounded edge value)
_UINT32_MAX = 0xFFFFFFFF
_UNKNOWN_MODEL = "_unknown"  # metric label for batches of models this worker does not serve (bounded)


@dataclass(eq=False)
class StreamState:
    """One router's stream: where its results go and which of its items were cancelled.

    Invariant: `cancelled` ⊆ `held` — only an item this worker holds can be cancelled, so a cancel that
    arrives after its item was answered (or for an id never sent) leaves nothing behind, and both sets
    are bounded by the worker's capacity."""

    outbox: asyncio.Queue[worker_pb2.WorkerMessage | None] = field(default_factory=asyncio.Queue)
    cancelled: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)
    """Item ids of this stream's accepted batches not yet answered."""
    open: bool = True

    def send(self, message: worker_pb2.WorkerMessage) -> None:
        """Queue a message for the router (dropped if the stream is gone: nobody is listening)."""
        if self.open:
            self.outbox.put_nowait(message)

    def cancel(self, item_ids: Iterable[int]) -> None:
        """The router gave up on these items: those still held are skipped or answered CANCELLED."""
        self.cancelled.update(item for item in item_ids if item in self.held)

    def settle(self, batch: worker_pb2.Batch) -> None:
        """Every item of an accepted batch has been answered (or dropped with the stream)."""
        for item in batch.items:
            self.held.discard(item.item_id)
            self.cancelled.discard(item.item_id)


def _error(item_id: int, err: SluiceError, *, worker_fault: bool = False) -> worker_pb2.ItemResult:
    error = worker_pb2.ItemError(
        code=int(err.code), message=err.message, worker_fault=worker_fault, reason=err.reason
    )
    return worker_pb2.ItemResult(item_id=item_id, error=error)


class BatchRunner:
    """Runs accepted batches on the device, merged where they can be, and answers each on its stream."""

    def __init__(
        self,
        executor: Executor,
        models: dict[tuple[str, str], LoadedModel],
        metrics: WorkerMetrics,
        *,
        capacity: int,
        now: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
        on_device_fault: Callable[[Internal], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._executor = executor
        self._models = models
        self._metrics = metrics
        self._capacity = capacity
        self._now = now
        self._on_device_fault = on_device_fault
        self._fault_reported = False
        self._device = DeviceThread(
            executor, models, now=now, tracer=tracer or NoOpTracer(), deliver=self._post
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0
        self._queued_items = 0
        self._queued_rows = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = BusyWindow(BUSY_WINDOW_S, BUSY_SLOTS)
        self.batches_executed = 0
        self.items_executed = 0

    @property
    def pending_batches(self) -> int:
        """Batches accepted and not yet answered (those executing included): never above `capacity`."""
        return self._pending

    @property
    def queued_items(self) -> int:
        """Items in batches accepted and not yet answered."""
        return self._queued_items

    @property
    def queued_rows(self) -> int:
        """Rows (items' leading dims, as the routers sent them) in batches accepted and not yet answered."""
        return self._queued_rows

    def start(self) -> None:
        """Start the device thread; answers are delivered on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._device.start()

    async def stop(self) -> None:
        """Stop the device thread after the forward it is running, if any; batches not run stay unanswered."""
        await self._device.stop()

    def submit(self, batch: worker_pb2.Batch, stream: StreamState) -> None:
        """Accept a batch for execution, or refuse it at once if the worker already holds `capacity`."""
        if self._pending >= self._capacity:
            self._refuse(batch, stream)
            return
        rows = _claimed_rows(batch)
        self._pending += 1
        self._queued_items += len(batch.items)
        self._queued_rows += rows
        self._idle.clear()
        self._metrics.queued_batches.set(self._pending)
        stream.held.update(item.item_id for item in batch.items)
        self._device.put(Work(batch, stream, self._now(), rows))

    async def wait_idle(self, within_s: float) -> bool:
        """Wait until no batch is queued or executing (False on timeout)."""
        try:
            await asyncio.wait_for(self._idle.wait(), within_s)
        except TimeoutError:
            return False
        return True

    def busy_fraction(self) -> float:
        """Share of the last BUSY_WINDOW_S the device spent on forwards (O(1): worker/busy.py)."""
        return self._busy.fraction(self._now())

    # -- the loop's side ----------------------------------------------------------------------------------
    def _refuse(self, batch: worker_pb2.Batch, stream: StreamState) -> None:
        busy = Unavailable(
            f"worker holds {self._pending} batches, its capacity ({self._capacity}); place this batch on "
            "another worker",
            reason=WORKER_BUSY,
        )
        result = worker_pb2.BatchResult(batch_id=batch.batch_id)
        result.items.extend(_error(item.item_id, busy) for item in batch.items)
        self._stamp_queue(result)
        stream.send(worker_pb2.WorkerMessage(result=result))
        label = self._label(batch)
        self._metrics.refused.labels(WORKER_BUSY).inc()
        self._metrics.items.labels(label, Code.UNAVAILABLE.name).inc(len(batch.items))

    def _finish(self, forward: Forward) -> None:
        """On the loop: answer every batch of a finished forward (or forget dropped ones)."""
        for answer in forward.answers:
            work = answer.work
            self._pending -= 1
            self._queued_items -= len(work.batch.items)
            self._queued_rows -= work.rows
        self._metrics.queued_batches.set(self._pending)
        if self._pending == 0:
            self._idle.set()
        if forward.dropped:
            for answer in forward.answers:
                answer.work.stream.settle(answer.work.batch)
            return
        self._busy.add(forward.start, forward.end)
        for answer in forward.answers:
            self._answer(answer, forward)
        label = self._label(forward.answers[0].work.batch)
        if forward.rows:
            self._metrics.batch_size.labels(label).observe(forward.rows)
            self._metrics.execute.labels(label).observe(forward.end - forward.start)
        fault = self._executor.fault
        if fault is not None and self._on_device_fault is not None and not self._fault_reported:
            self._fault_reported = True
            self._on_device_fault(fault)

    def _answer(self, answer: Answer, forward: Forward) -> None:
        work = answer.work
        result = worker_pb2.BatchResult(batch_id=work.batch.batch_id)
        try:
            for outcome in answer.skipped:
                result.items.append(_encode(outcome))
            result.items.extend(_encode(o, work.stream) for o in answer.executed)
        except Exception as exc:  # a bug must fail this batch's items, not stop the worker
            log.exception("answering batch %d failed", work.batch.batch_id)
            del result.items[:]
            result.items.extend(_encode(outcome) for outcome in fail_all(work.batch, exc))
        result.executed_size = answer.executed_rows
        result.forward_rows = forward.rows if answer.executed_rows else 0
        result.queue_us = round((forward.start - work.received_at) * 1e6)
        result.execute_us = round((forward.end - forward.start) * 1e6)
        self._stamp_queue(result)
        work.stream.send(worker_pb2.WorkerMessage(result=result))
        work.stream.settle(work.batch)
        self._account(work, result, forward.start)

    def _stamp_queue(self, result: worker_pb2.BatchResult) -> None:
        result.queued_batches = min(self._pending, _UINT32_MAX)
        result.queued_rows = min(max(self._queued_rows, 0), _UINT32_MAX)

    def _account(self, work: Work, result: worker_pb2.BatchResult, start: float) -> None:
        self.batches_executed += 1
        self.items_executed += result.executed_size
        label = self._label(work.batch)
        m = self._metrics
        m.batches.labels(label).inc()
        m.queue_wait.labels(label).observe(start - work.received_at)
        for item in result.items:
            code = item.error.code if item.HasField("error") else 0
            m.items.labels(label, _code_name(code)).inc()

    def _label(self, batch: worker_pb2.Batch) -> str:
        """The model as a metric label: only models served here, so a router cannot grow the label set."""
        return batch.model if (batch.model, batch.version) in self._models else _UNKNOWN_MODEL

    def _post(self, forward: Forward) -> None:
        """On the device thread: hand a finished forward to the loop, its one wake-up for all the forward's
        batches."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._finish, forward)
        except RuntimeError:  # the loop is closed: nobody is left to answer
            log.warning("event loop closed; %d batch answers dropped", len(forward.answers))


def _encode(outcome: ItemOutcome, stream: StreamState | None = None) -> worker_pb2.ItemResult:
    """The wire form of an outcome; with `stream`, an executed item the router cancelled meanwhile
    becomes CANCELLED instead of its outputs."""
    if stream is not None and outcome.item_id in stream.cancelled:
        return _error(outcome.item_id, Cancelled("cancelled by the router during execution"))
    if outcome.error is not None or outcome.outputs is None:
        error = outcome.error or SluiceError("no outputs")
        return _error(outcome.item_id, error, worker_fault=outcome.worker_fault)
    tensors = [to_wire(name, array) for name, array in outcome.outputs.items()]
    return worker_pb2.ItemResult(item_id=outcome.item_id, outputs=tensors)


def _claimed_rows(batch: worker_pb2.Batch) -> int:
    """The batch's rows as the router sent them (each item's first input's leading dim, bounded)."""
    rows = 0
    for item in batch.items:
        shape: Sequence[int] = item.inputs[0].shape if item.inputs else ()
        rows += min(max(shape[0], 1), _MAX_ITEM_ROWS) if shape else 1
    return rows


def _code_name(code: int) -> str:
    return Code(code).name if code in Code._value2member_map_ else str(code)
