"""The device thread: forms each forward from the batches waiting for the device, stages and runs it, and
hands every answer of it back in one call.

Ownership: one thread per device runs everything here except `put` and `stop` (the event loop's). It
owns the list of waiting batches and each `Work`'s fields past the first four; `Work` objects come in
through the inbox queue and go back inside a `Forward` through `deliver`, which order every access.
- Intake (once per batch): look up the model, decode and validate every item (worker/executor.py
  `check_item`), and key the batch for the merge (worker/merging.py): model, version, outputs, the one
  padded shape of its valid items, and the most rows a forward of that shape may take.
- Whenever the device is free: take everything that arrived, choose the next forward (`next_forward`:
  the oldest waiting batch plus the waiting batches it merges with; nobody waits for a partner), skip the
  items the router cancelled or whose budget ran out, stage and run the rest as one prepared batch, split
  the outcomes back per batch, and `deliver` the forward: one hand-off for all its batches.
- After a device fault every later forward is delivered `dropped`, its batches never run.
A stream's `cancelled` set and `open` flag are only read here (a membership test and a bool read are
atomic under the GIL); the event loop alone writes them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span, Tracer

from sluice_inference.common.errors import Cancelled, DeadlineExceeded, Internal, NotFound, SluiceError
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.telemetry import extract_mapping
from sluice_inference.common.tensors import from_wire
from sluice_inference.worker.executor import (
    CheckedItem,
    ExecItem,
    Executor,
    ItemOutcome,
    LoadedModel,
    check_item,
)
from sluice_inference.worker.merging import RUNS_ALONE, Candidate, MergeKey, max_rows, next_forward

if TYPE_CHECKING:
    from sluice_inference.worker.runner import StreamState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Work:
    """An accepted batch: the loop fills the first four fields at `submit`, the device thread the rest at
    intake (its decoded, validated items and what the merge needs to know)."""

    batch: worker_pb2.Batch
    stream: StreamState
    received_at: float
    rows: int
    model: LoadedModel | None = None
    items: list[tuple[CheckedItem, int]] = field(default_factory=list)  # (item, budget_us)
    failed: list[ItemOutcome] = field(default_factory=list)  # outcomes known before any forward
    candidate: Candidate = field(default_factory=lambda: RUNS_ALONE)


@dataclass
class Answer:
    """One batch's part of a forward: the items it runs, then the outcomes of items never run and of
    items run, and the rows of its own that went into the forward."""

    work: Work
    runnable: list[CheckedItem] = field(default_factory=list)
    skipped: list[ItemOutcome] = field(default_factory=list)
    executed: list[ItemOutcome] = field(default_factory=list)
    executed_rows: int = 0


@dataclass
class Forward:
    """What the device thread hands back: every batch of one forward (or batches dropped after a fault)."""

    answers: list[Answer]
    start: float
    end: float
    rows: int = 0
    dropped: bool = False


class DeviceThread:
    """The one thread that touches the device: turns accepted batches into forwards and their answers."""

    def __init__(
        self,
        executor: Executor,
        models: dict[tuple[str, str], LoadedModel],
        *,
        now: Callable[[], float],
        tracer: Tracer,
        deliver: Callable[[Forward], None],
    ) -> None:
        self._executor = executor
        self._models = models
        self._now = now
        self._tracer = tracer
        self._deliver = deliver
        self._inbox: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._device_loop, name="device", daemon=True)
        self._thread.start()

    def put(self, work: Work) -> None:
        """Hand an accepted batch to the thread (never blocks)."""
        self._inbox.put(work)

    async def stop(self) -> None:
        """Stop after the forward running now, if any; batches still waiting are never run or delivered."""
        if self._thread is None:
            return
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _device_loop(self) -> None:
        """Take what arrived, run the next forward, hand its answers to the loop; block only when idle."""
        waiting: list[Work] = []
        while True:
            arrived = self._take(block=not waiting)
            if arrived is None:
                return
            waiting.extend(self._intake(work) for work in arrived)
            chosen_at = set(next_forward([work.candidate for work in waiting]))
            chosen = [work for i, work in enumerate(waiting) if i in chosen_at]
            waiting = [work for i, work in enumerate(waiting) if i not in chosen_at]
            self._deliver(self._run(chosen))

    def _take(self, *, block: bool) -> list[Work] | None:
        """Everything in the inbox (waiting for the first one if `block`); None once told to stop."""
        arrived: list[Work] = []
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is None:
                    return None
                arrived.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return arrived

    def _intake(self, work: Work) -> Work:
        """Decode and validate a newly accepted batch's items once, and key it for the merge."""
        batch = work.batch
        try:
            work.model = self._models.get((batch.model, batch.version))
            if work.model is None:
                # The router believed this worker serves it: the item is not to blame.
                missing = NotFound(f"worker does not serve {batch.model} version {batch.version}")
                work.failed = [ItemOutcome(i.item_id, None, missing, worker_fault=True) for i in batch.items]
                return work
            config = work.model.spec.config
            for item in batch.items:
                try:
                    inputs = {t.name: from_wire(t) for t in item.inputs}
                except SluiceError as err:
                    work.failed.append(ItemOutcome(item.item_id, None, err))
                    continue
                work.items.append((check_item(config, ExecItem(item.item_id, inputs)), item.budget_us))
            shapes = {checked.shape for checked, _ in work.items if checked.shape is not None}
            rows = sum(checked.rows for checked, _ in work.items if checked.shape is not None)
            if len(shapes) == 1:
                shape = shapes.pop()
                key = MergeKey(batch.model, batch.version, tuple(batch.outputs), shape)
                work.candidate = Candidate(key, rows, max_rows(config, shape))
        except Exception as exc:  # a bug must fail this batch's items, not stop the device thread
            log.exception("decoding batch %d failed", batch.batch_id)
            work.items, work.failed = [], fail_all(batch, exc)
            work.candidate = RUNS_ALONE
        return work

    def _run(self, chosen: list[Work]) -> Forward:
        """Run one forward for `chosen` (batches of one merge key, or one batch alone)."""
        start = self._now()
        if self._executor.fault is not None:  # dropped unanswered (module docstring)
            return Forward([Answer(work) for work in chosen], start, start, dropped=True)
        answers = [self._select(work, start) for work in chosen]
        spans = [self._span(work) for work in chosen]
        forward = Forward(answers, start, start)
        try:
            forward.rows = self._execute(chosen[0], answers)
        except Exception as exc:  # a bug must fail these batches' items, not stop the device thread
            log.exception("executing batches %s failed", [work.batch.batch_id for work in chosen])
            for answer in answers:
                answer.skipped, answer.executed = fail_all(answer.work.batch, exc), []
                answer.executed_rows = 0
        finally:
            for span, answer in zip(spans, answers, strict=True):
                span.set_attribute("sluice.rows", answer.executed_rows)
                span.set_attribute("sluice.forward_rows", forward.rows)
                span.end()
        forward.end = self._now()
        return forward

    def _select(self, work: Work, now: float) -> Answer:
        """Split a batch into items to skip (cancelled, or their deadline passed) and items to run."""
        answer = Answer(work, skipped=list(work.failed))
        stream = work.stream
        for checked, budget_us in work.items:
            item_id = checked.item.item_id
            if item_id in stream.cancelled or not stream.open:
                answer.skipped.append(ItemOutcome(item_id, None, Cancelled("cancelled by the router")))
            elif budget_us and work.received_at + budget_us / 1e6 <= now:
                expired = DeadlineExceeded("deadline passed before execution")
                answer.skipped.append(ItemOutcome(item_id, None, expired))
            else:
                answer.runnable.append(checked)
        return answer

    def _execute(self, head: Work, answers: list[Answer]) -> int:
        """Stage and run the runnable items of every answer's batch (all of `head`'s model and outputs) as
        one prepared batch; fill each answer's outcomes and rows; the rows that went into forwards."""
        flat = [checked for answer in answers for checked in answer.runnable]
        if not flat or head.model is None:
            return 0
        prepared = self._executor.prepare_checked(head.model, flat, list(head.batch.outputs))
        outcomes = self._executor.execute(prepared)
        position = 0
        for answer in answers:
            count = len(answer.runnable)
            answer.executed = outcomes[position : position + count]
            answer.executed_rows = sum(
                checked.rows
                for index, checked in enumerate(answer.runnable, start=position)
                if index not in prepared.outcomes
            )
            position += count
        return prepared.forward_rows

    def _span(self, work: Work) -> Span:
        return self._tracer.start_span(
            "sluice.execute",
            context=extract_mapping(work.batch.trace_context),
            attributes={
                "sluice.model": work.batch.model,
                "sluice.version": work.batch.version,
                "sluice.items": len(work.batch.items),
            },
        )


def worker_bug(exc: Exception) -> Internal:
    """The error every item of a batch gets when the worker itself failed on it (a bug, not the model)."""
    return Internal(f"worker failed on this batch: {type(exc).__name__}: {exc}", reason="worker_bug")


def fail_all(batch: worker_pb2.Batch, exc: Exception) -> list[ItemOutcome]:
    """Every item of `batch` failed by `worker_bug(exc)`, blamed on the worker."""
    error = worker_bug(exc)
    return [ItemOutcome(item.item_id, None, error, worker_fault=True) for item in batch.items]
