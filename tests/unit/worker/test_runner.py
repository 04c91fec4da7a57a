"""BatchRunner: one result per batch with an outcome per item, skips, staging overlapping execution, blame
on the wire, and what happens after a device fault."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from common.errors import Code, Internal
from common.pb.sluice.v1 import worker_pb2
from common.tensors import from_wire, to_wire
from tests.unit.worker.fakes import (
    CountingBackend,
    FailingBackend,
    RecordingBackend,
    fake_model,
    synthetic_config,
)
from worker.backends.synthetic import POISON, SyntheticBackend
from worker.executor import ExecItem, Executor, ItemOutcome, LoadedModel, PreparedBatch
from worker.metrics import WorkerMetrics
from worker.model_config import ModelConfig
from worker.runner import BatchRunner, StreamState

MODEL = fake_model(synthetic_config(), RecordingBackend())


def batch(
    batch_id: int, item_ids: Sequence[int], budget_us: int = 10_000_000, model: str = "toy"
) -> worker_pb2.Batch:
    message = worker_pb2.Batch(batch_id=batch_id, model=model, version="1")
    for item_id in item_ids:
        x = np.full((1, 4), float(item_id), dtype="<f4")
        message.items.add(item_id=item_id, inputs=[to_wire("x", x)], budget_us=budget_us)
    return message


async def results(stream: StreamState, count: int) -> list[worker_pb2.BatchResult]:
    out: list[worker_pb2.BatchResult] = []
    while len(out) < count:
        message = await asyncio.wait_for(stream.outbox.get(), 5)
        assert message is not None
        if message.WhichOneof("kind") == "result":
            out.append(message.result)
    return out


async def run_batches(
    runner: BatchRunner, *batches: worker_pb2.Batch, stream: StreamState
) -> list[worker_pb2.BatchResult]:
    runner.start()
    try:
        for message in batches:
            runner.submit(message, stream)
        return await results(stream, len(batches))
    finally:
        await runner.stop()


async def test_every_item_gets_exactly_one_outcome() -> None:
    runner = BatchRunner(Executor(), {("toy", "1"): MODEL}, WorkerMetrics())
    stream = StreamState()
    stream.cancelled.add(2)
    [result] = await run_batches(runner, batch(7, [1, 2, 3]), stream=stream)
    by_id = {item.item_id: item for item in result.items}
    assert result.batch_id == 7 and sorted(by_id) == [1, 2, 3]
    assert by_id[2].error.code == Code.CANCELLED and not by_id[2].outputs
    np.testing.assert_array_equal(from_wire(by_id[3].outputs[0]), np.full((1, 4), 4.0, "<f4"))
    assert result.executed_size == 2


async def test_items_past_their_budget_are_not_executed() -> None:
    backend = RecordingBackend()
    runner = BatchRunner(Executor(), {("toy", "1"): fake_model(synthetic_config(), backend)}, WorkerMetrics())
    [result] = await run_batches(runner, batch(1, [5], budget_us=1), stream=StreamState())
    assert result.items[0].error.code == Code.DEADLINE_EXCEEDED
    assert backend.calls == []


async def test_unknown_model_fails_every_item_not_found() -> None:
    runner = BatchRunner(Executor(), {("toy", "1"): MODEL}, WorkerMetrics())
    [result] = await run_batches(runner, batch(1, [1, 2], model="other"), stream=StreamState())
    assert [i.error.code for i in result.items] == [Code.NOT_FOUND, Code.NOT_FOUND]


class SlowBackend(RecordingBackend):
    """Each forward takes 0.2 s, like a device busy with a large batch."""

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.2)
        return super().forward(inputs)


class TimedExecutor(Executor):
    """Records when each batch's staging started and when each forward ended."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def prepare(
        self, model: LoadedModel, items: Sequence[ExecItem], outputs: Sequence[str] = ()
    ) -> PreparedBatch:
        with self._lock:
            self.events.append(("prepare", time.monotonic()))
        return super().prepare(model, items, outputs)

    def execute(self, prepared: PreparedBatch) -> list[ItemOutcome]:
        outcomes = super().execute(prepared)
        with self._lock:
            self.events.append(("executed", time.monotonic()))
        return outcomes


async def test_next_batch_is_staged_while_the_current_one_executes() -> None:
    executor = TimedExecutor()
    model = fake_model(synthetic_config(), SlowBackend())
    runner = BatchRunner(executor, {("toy", "1"): model}, WorkerMetrics())
    await run_batches(runner, batch(1, [1]), batch(2, [2]), stream=StreamState())
    kinds = [kind for kind, _ in sorted(executor.events, key=lambda e: e[1])]
    assert kinds == ["prepare", "prepare", "executed", "executed"]


def poisoned(batch_id: int, values: Sequence[float]) -> worker_pb2.Batch:
    message = worker_pb2.Batch(batch_id=batch_id, model="toy", version="1")
    for item_id, value in enumerate(values):
        message.items.add(item_id=item_id, inputs=[to_wire("x", np.full((1, 4), value, "<f4"))])
    return message


async def test_item_errors_say_whether_the_worker_is_to_blame() -> None:
    config = synthetic_config()
    working = fake_model(config, SyntheticBackend(ModelConfig.model_validate(config), "cpu"))
    broken = fake_model(synthetic_config("broken"), FailingBackend())
    models = {("toy", "1"): working, ("broken", "1"): broken}
    runner = BatchRunner(Executor(), models, WorkerMetrics())
    only_bad = poisoned(1, [POISON, POISON])
    on_broken = batch(2, [1, 2], model="broken")
    unknown = batch(3, [1], model="absent")
    results = await run_batches(runner, only_bad, on_broken, unknown, stream=StreamState())
    blame = {r.batch_id: [(i.error.code, i.error.worker_fault) for i in r.items] for r in results}
    assert blame == {
        1: [(Code.INTERNAL, False)] * 2,  # the model runs its canary: these items are the client's doing
        2: [(Code.INTERNAL, True)] * 2,  # the model fails its canary too: the worker is broken
        3: [(Code.NOT_FOUND, True)],  # the router believed this worker serves it
    }


async def test_after_a_device_fault_only_the_faulted_batch_is_answered() -> None:
    simulated = synthetic_config(synthetic={"base_ms": 0, "per_item_ms": 0, "fault_trigger": 7.0})
    backend = CountingBackend(SyntheticBackend(ModelConfig.model_validate(simulated), "cpu"))
    faults: list[Internal] = []
    runner = BatchRunner(
        Executor(),
        {("toy", "1"): fake_model(simulated, backend)},
        WorkerMetrics(),
        on_device_fault=faults.append,
    )
    stream = StreamState()
    runner.start()
    try:
        for message in (poisoned(1, [1.0, 7.0]), poisoned(2, [1.0]), poisoned(3, [2.0])):
            runner.submit(message, stream)
        [result] = await results(stream, 1)
        assert await runner.wait_idle(within_s=5)
    finally:
        await runner.stop()
    assert result.batch_id == 1
    assert [(i.error.code, i.error.worker_fault) for i in result.items] == [(Code.INTERNAL, True)] * 2
    assert "device-side assert" in result.items[0].error.message
    assert len(faults) == 1 and faults[0].reason == "device_fault"
    assert stream.outbox.empty()  # batches 2 and 3 are never answered: routers re-dispatch them
    assert backend.rows == [2]  # nor run: the device is never touched again
    assert runner.pending_batches == 0
