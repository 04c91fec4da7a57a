"""The device thread: forms each forward from the batches waiting for the device, stages and runs it, and
hands every answer of it back in one call.

Ownership: one thread per device runs everything here except `put` and `stop` (the event loop's). It
owns the list of waiting batches and each `Work`'s fields past the first four; `Work` objects come in
through the inbox queue and go back inside a `Forward` through `deliver`, which order every access.
- Intake (once per batch): look up the model, decode the items (one `frombuffer` per input, each item a
  view of it: common/batch_tensors.py), validate each (worker/executor.py `check_item`), and key the
  batch for the merge (common/batching.py): model, version, outputs and the one padded shape of its
  valid items, its valid rows and their cost, and the model's limits on one forward.
- Whenever the device is free: take everything that arrived, choose the next forward (`next_forward`:
  the oldest waiting batch plus the waiting batches it merges with; nobody waits for a partner), skip the
  items the router cancelled or whose budget ran out, stage and run the rest as one prepared batch, split
  the outcomes back per batch, and `deliver` the forward: one hand-off for all its batches.
- After a device fault every later forward is delivered `dropped`, its batches never run.
An execute span is opened only for a batch the router traced (it carries a trace context) and only when
the worker has a tracer: otherwise a batch costs no tracing work.
A stream's `cancelled` set and `open` flag are only read here (a membership test and a bool read are
atomic under the GIL); the event loop alone writes them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from opentelemetry.trace import NoOpTracer, Span, Tracer

from sluice_inference.common.batch_tensors import row_ranges, split_arrays, whole_array
from sluice_inference.common.batching import RUNS_ALONE, Candidate, next_forward
from sluice_inference.common.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    SluiceError,
)
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.telemetry import extract_mapping
from sluice_inference.worker.executor import (
    Array,
    CheckedItem,
    ExecItem,
    Executor,
    ItemOutcome,
    LoadedModel,
    check_items,
)
from sluice_inference.worker.padding import ShapeKey

if TYPE_CHECKING:
    from sluice_inference.worker.runner import StreamState

log = logging.getLogger(__name__)


class MergeKey(NamedTuple):
    """What batches must share to stack into one forward (common/batching.py `next_forward`); a named
    tuple, the cheapest hashable record to build once per batch."""

    model: str
    version: str
    outputs: tuple[str, ...]
    shape: ShapeKey


@dataclass(eq=False, slots=True)
class Work:
    """An accepted batch and, once it ran, its answer. The loop fills the first four fields at `submit`;
    the device thread the rest: at intake its decoded, validated items and what the merge needs to know,
    when its forward runs the outcomes (items never run, items run) and its own rows that went in. One
    object per batch from arrival to answer."""

    batch: worker_pb2.Batch
    stream: StreamState
    received_at: float
    rows: int
    model: LoadedModel | None = None
    # Empty until set: each list is made by the step that fills it, so an accepted batch allocates none
    # it does not use.
    items: Sequence[tuple[CheckedItem, int]] = ()  # (item, budget_us)
    failed: Sequence[ItemOutcome] = ()  # outcomes known before any forward
    candidate: Candidate = RUNS_ALONE
    runnable: Sequence[CheckedItem] = ()
    skipped: Sequence[ItemOutcome] = ()
    executed: Sequence[ItemOutcome] = ()
    executed_rows: int = 0


@dataclass
class Forward:
    """What the device thread hands back: every batch of one forward (or batches dropped after a fault)."""

    works: list[Work]
    start: float
    end: float
    rows: int = 0
    dropped: bool = False


class DeviceThread:
    """The one thread that touches the device: turns accepted batches into forwards and their answers.

    With `on_loop` there is no thread: the same steps run on the event loop, one forward per loop pass
    (so stream reads and load reports interleave between forwards), and a forward costs no thread
    hand-off in either direction. Only for forwards far shorter than the routers' heartbeat (0.8 s):
    the loop does nothing else while one runs. Why it is not the default even on a CPU, where it saves
    about a fifth of the worker's CPU per one-row batch (docs/performance.md, "The hop"): warm-up cannot
    prove that no input makes a forward hang or run long, and such a forward would silence the stream,
    so routers would drop the worker (UNAVAILABLE) instead of letting its item expire on it
    (tests/integration/test_after_dispatch.py). Blocking the loop a few ms for each forward it starts,
    to take the answer without the self-pipe wake-up, saved nothing measurable (2026-12-01): the cost is
    the switch to and from the thread itself."""

    def __init__(
        self,
        executor: Executor,
        models: dict[tuple[str, str], LoadedModel],
        *,
        now: Callable[[], float],
        tracer: Tracer,
        deliver: Callable[[Forward], None],
        on_loop: bool = False,
    ) -> None:
        self._executor = executor
        self._models = models
        self._now = now
        self._tracer = tracer
        self._traced = not isinstance(tracer, NoOpTracer)
        self._deliver = deliver
        self._inbox: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.on_loop = on_loop
        self._waiting: list[Work] = []
        """On the loop only: accepted batches not yet run (the thread keeps its own list)."""
        self._step: asyncio.Handle | None = None
        self._stopped = False

    def start(self) -> None:
        """Start the thread (nothing to start on the loop)."""
        if self.on_loop:
            return
        self._thread = threading.Thread(target=self._device_loop, name="device", daemon=True)
        self._thread.start()

    def put(self, work: Work) -> None:
        """Hand an accepted batch to the thread (never blocks); on the loop, take it in and run it on the
        next loop pass."""
        if not self.on_loop:
            self._inbox.put(work)
            return
        self._waiting.append(self._intake(work))
        if self._step is None and not self._stopped:
            self._step = asyncio.get_running_loop().call_soon(self._run_next)

    async def stop(self) -> None:
        """Stop after the forward running now, if any; batches still waiting are never run or delivered."""
        self._stopped = True
        if self._step is not None:
            self._step.cancel()
            self._step = None
        if self._thread is None:
            return
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _run_next(self) -> None:
        """On the loop: run the next forward, then give the loop a pass before the one after."""
        self._step = None
        if self._stopped or not self._waiting:
            return
        chosen, self._waiting = _next(self._waiting)
        forward = self._run(chosen)
        if self._waiting:  # before delivering: a failing delivery must not strand the batches still waiting
            self._step = asyncio.get_running_loop().call_soon(self._run_next)
        self._deliver(forward)

    def _device_loop(self) -> None:
        """Take what arrived, run the next forward, hand its answers to the loop; block only when idle."""
        waiting: list[Work] = []
        while True:
            arrived = self._take(block=not waiting)
            if arrived is None:
                return
            for work in arrived:
                waiting.append(self._intake(work))
            chosen, waiting = _next(waiting)
            self._deliver(self._run(chosen))

    def _take(self, *, block: bool) -> list[Work] | None:
        """Everything in the inbox (waiting for the first one if `block`); None once told to stop."""
        inbox = self._inbox
        arrived: list[Work] = []
        if block:
            first = inbox.get()
            if first is None:
                return None
            arrived.append(first)
        # Only this thread takes from the inbox, so what `empty` says is there stays there: no Empty raised
        # and caught on every wake-up.
        while not inbox.empty():
            item = inbox.get_nowait()
            if item is None:
                return None
            arrived.append(item)
        return arrived

    def _intake(self, work: Work) -> Work:
        """Decode and validate a newly accepted batch's items once, and key it for the merge."""
        batch = work.batch
        try:
            work.model = self._models.get((batch.model, batch.version))
            if work.model is None:
                # The router believed this worker serves it: the item is not to blame.
                missing = NotFound(f"worker does not serve {batch.model} version {batch.version}")
                work.failed = [ItemOutcome(i, None, missing, worker_fault=True) for i in batch.item_ids]
                return work
            try:
                items, whole = _decode(batch)
            except SluiceError as err:  # the batch as a whole is malformed: every item fails with it
                work.failed = [ItemOutcome(i, None, err) for i in batch.item_ids]
                return work
            checked = check_items(work.model, items, batch.item_rows, whole)
            work.items = list(zip(checked, batch.budgets_us, strict=True))
            config = work.model.spec.config
            shape: ShapeKey | None = None
            rows = 0
            for item in checked:
                if item.shape is None:
                    continue
                if shape is not None and item.shape != shape:  # two padded shapes: it merges with none
                    break
                shape = item.shape
                rows += item.rows
            else:
                if shape is not None:
                    key = MergeKey(batch.model, batch.version, tuple(batch.outputs), shape)
                    cost = rows * config.row_cost_of(shape)
                    work.candidate = Candidate(key, rows, cost, config.batch_limits)
        except Exception as exc:  # a bug must fail this batch's items, not stop the device thread
            log.exception("decoding batch %d failed", batch.batch_id)
            work.items, work.failed = [], fail_all(batch, exc)
            work.candidate = RUNS_ALONE
        return work

    def _run(self, chosen: list[Work]) -> Forward:
        """Run one forward for `chosen` (batches of one merge key, or one batch alone)."""
        start = self._now()
        forward = Forward(chosen, start, start)
        if self._executor.fault is not None:  # dropped unanswered (module docstring)
            forward.dropped = True
            return forward
        for work in chosen:
            self._select(work, start)
        spans = [self._span(work) for work in chosen] if self._traced else []
        try:
            forward.rows = self._execute(chosen[0], chosen)
        except Exception as exc:  # a bug must fail these batches' items, not stop the device thread
            log.exception("executing batches %s failed", [work.batch.batch_id for work in chosen])
            for work in chosen:
                work.skipped, work.executed = fail_all(work.batch, exc), []
                work.executed_rows = 0
        finally:
            for span, work in zip(spans, chosen, strict=False):
                if span is not None:
                    span.set_attribute("sluice.rows", work.executed_rows)
                    span.set_attribute("sluice.forward_rows", forward.rows)
                    span.end()
        forward.end = self._now()
        return forward

    def _select(self, work: Work, now: float) -> None:
        """Split a batch into items to skip (cancelled, or their deadline passed) and items to run."""
        skipped = list(work.failed)
        runnable: list[CheckedItem] = []
        stream = work.stream
        cancelled, is_open = stream.cancelled, stream.open
        for checked, budget_us in work.items:
            item_id = checked.item.item_id
            if not is_open or item_id in cancelled:
                skipped.append(ItemOutcome(item_id, None, Cancelled("cancelled by the router")))
            elif budget_us and work.received_at + budget_us / 1e6 <= now:
                expired = DeadlineExceeded("deadline passed before execution")
                skipped.append(ItemOutcome(item_id, None, expired))
            else:
                runnable.append(checked)
        work.skipped, work.runnable = skipped, runnable

    def _execute(self, head: Work, works: list[Work]) -> int:
        """Stage and run the runnable items of every batch in `works` (all of `head`'s model and outputs)
        as one prepared batch; fill each one's outcomes and rows; the rows that went into forwards."""
        flat = [checked for work in works for checked in work.runnable]
        if not flat or head.model is None:
            return 0
        prepared = self._executor.prepare_checked(head.model, flat, list(head.batch.outputs))
        outcomes = self._executor.execute(prepared)
        forward_rows = prepared.forward_rows
        if len(works) == 1 and not prepared.outcomes:  # the usual forward: one batch, every item valid
            head.executed = outcomes
            head.executed_rows = forward_rows  # every item went into a forward
            return forward_rows
        position = 0
        for work in works:
            count = len(work.runnable)
            work.executed = outcomes[position : position + count]
            work.executed_rows = sum(
                checked.rows
                for index, checked in enumerate(work.runnable, start=position)
                if index not in prepared.outcomes
            )
            position += count
        return forward_rows

    def _span(self, work: Work) -> Span | None:
        """The execute span, a child of the router's batch span: only for batches the router traced
        (sampled), so an untraced batch costs no span work here."""
        if not work.batch.trace_context:
            return None
        return self._tracer.start_span(
            "sluice.execute",
            context=extract_mapping(work.batch.trace_context),
            attributes={
                "sluice.model": work.batch.model,
                "sluice.version": work.batch.version,
                "sluice.items": len(work.batch.item_ids),
            },
        )


def _next(waiting: list[Work]) -> tuple[list[Work], list[Work]]:
    """The batches of the next forward (common/batching.py `next_forward`) and those left waiting, in
    order."""
    if len(waiting) == 1:  # the usual case at low load: nothing to merge with, nothing to choose
        return waiting, []
    chosen_at = set(next_forward([work.candidate for work in waiting]))
    chosen = [work for i, work in enumerate(waiting) if i in chosen_at]
    return chosen, [work for i, work in enumerate(waiting) if i not in chosen_at]


def _decode(batch: worker_pb2.Batch) -> tuple[list[ExecItem], dict[str, Array] | None]:
    """Each item with its inputs (views of one buffer per input: common/batch_tensors.py), and those
    buffers as arrays when no input is ragged (the checks then run once: `check_items`); InvalidArgument
    when the packed lists or buffers disagree (the whole batch is malformed)."""
    ids, rows, budgets = batch.item_ids, batch.item_rows, batch.budgets_us
    if not len(ids) == len(rows) == len(budgets):
        raise InvalidArgument(
            f"batch {batch.batch_id}: {len(ids)} item ids, {len(rows)} item rows, {len(budgets)} budgets",
            reason="bad_batch",
        )
    whole: dict[str, Array] | None = {}
    columns = []
    for tensor in batch.inputs:
        if tensor.ragged:
            whole = None
            columns.append((tensor.name, split_arrays(tensor, rows)))
        else:
            array = whole_array(tensor, rows)
            if whole is not None:
                whole[tensor.name] = array
            columns.append((tensor.name, row_ranges(array, rows)))
    items = [
        ExecItem(item_id, {name: arrays[i] for name, arrays in columns}) for i, item_id in enumerate(ids)
    ]
    return items, whole


def worker_bug(exc: Exception) -> Internal:
    """The error every item of a batch gets when the worker itself failed on it (a bug, not the model)."""
    return Internal(f"worker failed on this batch: {type(exc).__name__}: {exc}", reason="worker_bug")


def fail_all(batch: worker_pb2.Batch, exc: Exception) -> list[ItemOutcome]:
    """Every item of `batch` failed by `worker_bug(exc)`, blamed on the worker."""
    error = worker_bug(exc)
    return [ItemOutcome(item_id, None, error, worker_fault=True) for item_id in batch.item_ids]
