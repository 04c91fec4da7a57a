"""The batch runner: the device's queue across every router's stream, merged forwards, one answer per batch.

Ownership and threads: this class lives on the event loop: it accepts batches, keeps the queue's counts
and sends answers. One device thread (worker/device_thread.py) does all the rest, so the device never
waits for the loop and the loop is woken once per forward (with `forward_on_loop` the same steps run on
the loop itself, one forward per loop pass, and nothing is handed between threads).
- `submit` accepts the batches of one stream message, each refused at once when the worker already holds
  `capacity` batches (all routers' streams together): every item UNAVAILABLE with reason "worker_busy",
  never executed, not the worker's fault, so the router places it elsewhere.
- The device thread, whenever the device is free, runs the oldest waiting batch merged with the waiting
  batches of the same model, version, outputs and padded shape that fit (common/batching.py; from any
  stream; nothing waits for a merge partner), and hands the answers of every batch in that forward back
  with one `call_soon_threadsafe`.
- `_finish` (on the loop) encodes each batch's outcomes — one buffer per output for the items that
  succeeded (common/batch_tensors.py), an error for each one that did not — with the queue left behind it
  (`queued_batches`, `queued_rows`) and the forward's rows (`forward_rows`), and sends the BatchResults
  of one forward to one stream in one message.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from opentelemetry.trace import NoOpTracer, Tracer

from sluice_inference.common.batch_tensors import pack_arrays
from sluice_inference.common.clock import Clock, wait_until
from sluice_inference.common.errors import Cancelled, Code, Internal, SluiceError, Unavailable
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.worker.busy import BusyWindow
from sluice_inference.worker.device_thread import DeviceThread, Forward, Work, fail_all
from sluice_inference.worker.executor import Array, Executor, ItemOutcome, LoadedModel
from sluice_inference.worker.metrics import ModelMetrics, WorkerMetrics

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
    reads_interval: bool = False
    """The router reads `LoadReport.report_interval_ms`: the worker may report less often when idle."""

    def send(self, message: worker_pb2.WorkerMessage) -> None:
        """Queue a message for the router (dropped if the stream is gone: nobody is listening)."""
        if self.open:
            self.outbox.put_nowait(message)

    def cancel(self, item_ids: Iterable[int]) -> None:
        """The router gave up on these items: those still held are skipped or answered CANCELLED."""
        self.cancelled.update(item for item in item_ids if item in self.held)

    def settle(self, item_ids: Sequence[int]) -> None:
        """Every item of an accepted batch has been answered (or dropped with the stream)."""
        self.held.difference_update(item_ids)
        if self.cancelled:
            self.cancelled.difference_update(item_ids)


def _error(item_id: int, err: SluiceError, *, worker_fault: bool = False) -> worker_pb2.ItemError:
    return worker_pb2.ItemError(
        item_id=item_id, code=int(err.code), message=err.message, worker_fault=worker_fault, reason=err.reason
    )


class BatchRunner:
    """Runs accepted batches on the device, merged where they can be, and answers each on its stream."""

    def __init__(
        self,
        executor: Executor,
        models: dict[tuple[str, str], LoadedModel],
        metrics: WorkerMetrics,
        *,
        capacity: int,
        clock: Clock,
        tracer: Tracer | None = None,
        on_device_fault: Callable[[Internal], None] | None = None,
        forward_on_loop: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._executor = executor
        self._models = models
        self._metrics = metrics
        self._capacity = capacity
        self._clock = clock
        self._now = clock.now
        self._on_device_fault = on_device_fault
        self._fault_reported = False
        self._device = DeviceThread(
            executor,
            models,
            now=clock.now,
            tracer=tracer or NoOpTracer(),
            deliver=self._finish if forward_on_loop else self._post,
            on_loop=forward_on_loop,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0
        self._queued_items = 0
        self._queued_rows = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = BusyWindow(BUSY_WINDOW_S, BUSY_SLOTS)
        # Read when scraped, so no batch pays for setting it (the count changes twice per batch).
        metrics.queued_batches.set_function(lambda: self._pending)
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

    def submit(self, batches: Sequence[worker_pb2.Batch], stream: StreamState) -> None:
        """Accept the batches of one stream message for execution, each refused at once if the worker
        already holds `capacity` (the refusals go back in one message)."""
        refused: worker_pb2.WorkerMessage | None = None
        received_at = self._now()  # the message's batches arrived together
        for batch in batches:
            if self._pending >= self._capacity:
                if refused is None:
                    refused = worker_pb2.WorkerMessage()
                refused.results.append(self._refuse(batch))
                continue
            rows = _claimed_rows(batch)
            item_ids = batch.item_ids
            self._pending += 1
            self._queued_items += len(item_ids)
            self._queued_rows += rows
            stream.held.update(item_ids)
            self._device.put(Work(batch, stream, received_at, rows))
        if refused is not None:
            stream.send(refused)
        self._idle.clear()

    async def wait_idle(self, within_s: float) -> bool:
        """Wait until no batch is queued or executing (False on timeout)."""
        idle = asyncio.ensure_future(self._idle.wait())
        if await wait_until(self._clock, {idle}, self._clock.now() + within_s):
            return True
        idle.cancel()
        return False

    def busy_fraction(self) -> float:
        """Share of the last BUSY_WINDOW_S the device spent on forwards (O(1): worker/busy.py)."""
        return self._busy.fraction(self._now())

    # -- the loop's side ----------------------------------------------------------------------------------
    def _refuse(self, batch: worker_pb2.Batch) -> worker_pb2.BatchResult:
        busy = Unavailable(
            f"worker holds {self._pending} batches, its capacity ({self._capacity}); place this batch on "
            "another worker",
            reason=WORKER_BUSY,
        )
        result = worker_pb2.BatchResult(batch_id=batch.batch_id)
        result.errors.extend(_error(item_id, busy) for item_id in batch.item_ids)
        self._stamp_queue(result)
        self._metrics.refused.labels(WORKER_BUSY).inc()
        self._bound(batch).items(Code.UNAVAILABLE).inc(len(batch.item_ids))
        return result

    def _finish(self, forward: Forward) -> None:
        """On the loop: answer every batch of a finished forward (or forget dropped ones), the answers to
        one stream in one message."""
        works = forward.works
        for work in works:
            self._pending -= 1
            self._queued_items -= len(work.batch.item_ids)
            self._queued_rows -= work.rows
        if self._pending == 0:
            self._idle.set()
        if forward.dropped:
            for work in works:
                work.stream.settle(work.batch.item_ids)
            return
        self._busy.add(forward.start, forward.end)
        bound = self._bound_work(works[0])  # a forward's batches share their model (one merge key)
        messages: dict[StreamState, worker_pb2.WorkerMessage] = {}
        for work in works:
            message = messages.get(work.stream)
            if message is None:
                message = messages[work.stream] = worker_pb2.WorkerMessage()
            self._answer(work, forward, bound, message.results.add())
        for stream, message in messages.items():
            stream.send(message)
        if forward.rows:
            bound.batch_size.observe(forward.rows)
            bound.execute.observe(forward.end - forward.start)
        fault = self._executor.fault
        if fault is not None and self._on_device_fault is not None and not self._fault_reported:
            self._fault_reported = True
            self._on_device_fault(fault)

    def _answer(
        self, work: Work, forward: Forward, bound: ModelMetrics, result: worker_pb2.BatchResult
    ) -> None:
        """Fill one batch's `result` (built in place in its message): one buffer per output for the items
        that ran, errors for the rest."""
        result.batch_id = work.batch.batch_id
        try:
            ok = _encode(result, work.skipped, work.executed, work.stream.cancelled)
        except Exception as exc:  # a bug must fail this batch's items, not stop the worker
            log.exception("answering batch %d failed", work.batch.batch_id)
            result.Clear()
            result.batch_id = work.batch.batch_id
            ok = _encode(result, fail_all(work.batch, exc), [], set())
        result.executed_size = work.executed_rows
        result.forward_rows = forward.rows if work.executed_rows else 0
        result.queue_us = round((forward.start - work.received_at) * 1e6)
        result.execute_us = round((forward.end - forward.start) * 1e6)
        self._stamp_queue(result)
        work.stream.settle(work.batch.item_ids)
        self._account(work, result, forward.start, bound, ok)

    def _stamp_queue(self, result: worker_pb2.BatchResult) -> None:
        result.queued_batches = min(self._pending, _UINT32_MAX)
        result.queued_rows = min(max(self._queued_rows, 0), _UINT32_MAX)

    def _account(
        self, work: Work, result: worker_pb2.BatchResult, start: float, bound: ModelMetrics, ok: int
    ) -> None:
        self.batches_executed += 1
        self.items_executed += result.executed_size
        bound.batches.inc()
        bound.queue_wait.observe(start - work.received_at)
        if ok:
            bound.items(Code.OK).inc(ok)
        for error in result.errors:
            bound.items(error.code).inc()

    def _bound(self, batch: worker_pb2.Batch) -> ModelMetrics:
        """The metric children of the batch's model, bound once: only models served here, so a router
        cannot grow the label set."""
        served = (batch.model, batch.version) in self._models
        return self._metrics.model(batch.model if served else _UNKNOWN_MODEL)

    def _bound_work(self, work: Work) -> ModelMetrics:
        """`_bound` for a batch the device thread took in: the model it found names the children, so no
        name is read from the wire again."""
        if work.model is None:
            return self._bound(work.batch)
        return self._metrics.model(work.model.spec.name)

    def _post(self, forward: Forward) -> None:
        """On the device thread: hand a finished forward to the loop, its one wake-up for all the forward's
        batches."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._finish, forward)
        except RuntimeError:  # the loop is closed: nobody is left to answer
            log.warning("event loop closed; %d batch answers dropped", len(forward.works))


def _encode(
    result: worker_pb2.BatchResult,
    skipped: Sequence[ItemOutcome],
    executed: Sequence[ItemOutcome],
    cancelled: set[int],
) -> int:
    """Fill `result` with the outcomes: an error per failed item, and the items that succeeded as one
    buffer per output; how many succeeded. An executed item the router cancelled meanwhile becomes
    CANCELLED instead of its outputs."""
    errors = result.errors
    for outcome in skipped:
        errors.append(_failure(outcome))
    ok_ids: list[int] = []
    ok_rows: list[int] = []
    columns: dict[str, list[Array]] = {}
    for outcome in executed:
        if outcome.item_id in cancelled:
            errors.append(_error(outcome.item_id, Cancelled("cancelled by the router during execution")))
        elif outcome.error is not None or outcome.outputs is None:
            errors.append(_failure(outcome))
        else:
            ok_ids.append(outcome.item_id)
            arrays = outcome.outputs
            ok_rows.append(len(next(iter(arrays.values()))) if arrays else 0)
            for name, array in arrays.items():
                columns.setdefault(name, []).append(array)
    result.item_ids.extend(ok_ids)
    result.item_rows.extend(ok_rows)
    outputs = result.outputs
    for name, column in columns.items():
        outputs.append(pack_arrays(name, column))
    return len(ok_ids)


def _failure(outcome: ItemOutcome) -> worker_pb2.ItemError:
    error = outcome.error or SluiceError("no outputs")
    return _error(outcome.item_id, error, worker_fault=outcome.worker_fault)


def _claimed_rows(batch: worker_pb2.Batch) -> int:
    """The batch's rows as the router sent them (each item's rows, bounded)."""
    total = 0
    for rows in batch.item_rows:
        total += min(max(rows, 1), _MAX_ITEM_ROWS)
    return total
