"""BatchRunner: one result per batch with an outcome per item, skips, merged forwards across streams with
each stream answered on its own, isolation and blame across a merge, capacity, the queue on every answer,
busy time under a fake clock, and what happens after a device fault.

Tests that need batches to wait for the device hold it with a `GatedBackend` batch first: everything
submitted while the gate is shut is waiting when the device is next free, so merges are deterministic."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sluice_inference.common.clock import FakeClock, MonotonicClock
from sluice_inference.common.errors import Code, Internal
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.worker.backends import Backend
from sluice_inference.worker.backends.synthetic import POISON, SyntheticBackend
from sluice_inference.worker.executor import Executor, LoadedModel
from sluice_inference.worker.metrics import WorkerMetrics
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.runner import WORKER_BUSY, BatchRunner, StreamState
from tests.support.hop import first_values, items, packed_batch
from tests.unit.worker.fakes import (
    CountingBackend,
    FailingBackend,
    GatedBackend,
    RecordingBackend,
    fake_model,
    synthetic_config,
)

MODEL = fake_model(synthetic_config(), RecordingBackend())
Models = dict[tuple[str, str], LoadedModel]


def batch(
    batch_id: int,
    item_ids: Sequence[int],
    budget_us: int = 10_000_000,
    model: str = "toy",
    *,
    version: str = "1",
    offset: float = 0.0,
    width: int = 4,
    outputs: Sequence[str] = (),
) -> worker_pb2.Batch:
    """Items of one row each whose values are `offset + item_id` (so outputs show whose item it was)."""
    rows = [(i, {"x": np.full((1, width), offset + i, dtype="<f4")}) for i in item_ids]
    return packed_batch(batch_id, model, version, rows, budget_us=budget_us, outputs=outputs)


def poisoned(batch_id: int, values: Sequence[float], model: str = "toy") -> worker_pb2.Batch:
    rows = [(i, {"x": np.full((1, 4), value, "<f4")}) for i, value in enumerate(values)]
    return packed_batch(batch_id, model, "1", rows)


def make_runner(models: Models, capacity: int = 8, **kwargs: Any) -> tuple[BatchRunner, WorkerMetrics]:
    metrics = WorkerMetrics()
    kwargs.setdefault("clock", MonotonicClock())
    return BatchRunner(Executor(), models, metrics, capacity=capacity, **kwargs), metrics


def gated_models(**extra: LoadedModel) -> tuple[Models, GatedBackend]:
    """A `hold` model whose forwards wait for the test's gate, plus `extra` models keyed (name, "1")."""
    gated = GatedBackend(RecordingBackend())
    models = {("hold", "1"): fake_model(synthetic_config("hold"), gated)}
    models.update({(model.spec.name, model.spec.version): model for model in extra.values()})
    return models, gated


async def hold_device(runner: BatchRunner, gated: GatedBackend, stream: StreamState) -> None:
    """Occupy the device with one `hold` batch (id 999) until the gate opens."""
    runner.submit([batch(999, [999], model="hold")], stream)
    assert await asyncio.to_thread(gated.started.wait, 5)


async def results(stream: StreamState, count: int) -> list[worker_pb2.BatchResult]:
    out: list[worker_pb2.BatchResult] = []
    while len(out) < count:
        message = await asyncio.wait_for(stream.outbox.get(), 5)
        assert message is not None
        out.extend(message.results)
    assert len(out) == count, f"{len(out)} results, expected {count}"
    return out


async def run_batches(
    runner: BatchRunner, *batches: worker_pb2.Batch, stream: StreamState
) -> list[worker_pb2.BatchResult]:
    runner.start()
    try:
        for message in batches:
            runner.submit([message], stream)
        return await results(stream, len(batches))
    finally:
        await runner.stop()


values = first_values


def sample(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_every_item_gets_exactly_one_outcome() -> None:
    runner, _ = make_runner({("toy", "1"): MODEL})
    stream = StreamState()
    stream.cancelled.add(2)
    [result] = await run_batches(runner, batch(7, [1, 2, 3]), stream=stream)
    by_id = {item.item_id: item for item in items(result)}
    assert result.batch_id == 7 and sorted(by_id) == [1, 2, 3]
    assert by_id[2].error.code == Code.CANCELLED and not by_id[2].outputs
    np.testing.assert_array_equal(by_id[3].outputs[0], np.full((1, 4), 4.0, "<f4"))
    assert result.executed_size == 2 and result.forward_rows == 2


async def test_items_past_their_budget_are_not_executed() -> None:
    backend = RecordingBackend()
    runner, _ = make_runner({("toy", "1"): fake_model(synthetic_config(), backend)})
    [result] = await run_batches(runner, batch(1, [5], budget_us=1), stream=StreamState())
    assert items(result)[0].error.code == Code.DEADLINE_EXCEEDED
    assert result.executed_size == result.forward_rows == 0
    assert backend.calls == []


async def test_unknown_model_fails_every_item_not_found() -> None:
    runner, _ = make_runner({("toy", "1"): MODEL})
    [result] = await run_batches(runner, batch(1, [1, 2], model="other"), stream=StreamState())
    assert [i.error.code for i in items(result)] == [Code.NOT_FOUND, Code.NOT_FOUND]


async def test_batches_waiting_on_two_streams_run_as_one_forward_each_answered_on_its_own() -> None:
    counting = CountingBackend(RecordingBackend())
    models, gated = gated_models(toy=fake_model(synthetic_config(), counting))
    runner, metrics = make_runner(models)
    a, b = StreamState(), StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, a)
        # Same batch id and item ids on both streams: ids are only unique within a stream.
        runner.submit([batch(2, [1, 2], offset=10)], a)
        runner.submit([batch(2, [1, 2, 3], offset=20)], b)
        runner.submit([batch(3, [4], offset=10)], a)
        gated.gate.set()
        [held, from_a, also_from_a] = await results(a, 3)
        [from_b] = await results(b, 1)
        assert await runner.wait_idle(within_s=5)
    finally:
        await runner.stop()
    assert counting.rows == [6]  # three batches, one forward
    assert (held.batch_id, held.forward_rows) == (999, 1)
    assert values(from_a) == {1: 12.0, 2: 13.0} and values(also_from_a) == {4: 15.0}
    assert values(from_b) == {1: 22.0, 2: 23.0, 3: 24.0}
    assert [r.executed_size for r in (from_a, also_from_a, from_b)] == [2, 1, 3]
    assert [r.forward_rows for r in (from_a, also_from_a, from_b)] == [6, 6, 6]
    assert a.outbox.empty() and b.outbox.empty()  # nobody got anyone else's answer
    # The histogram records forwards; the counter, the routers' batches.
    assert sample(metrics, "sluice_worker_batch_size_count", model="toy") == 1
    assert sample(metrics, "sluice_worker_batch_size_sum", model="toy") == 6
    assert sample(metrics, "sluice_worker_batches_total", model="toy") == 3


async def test_a_bad_item_of_one_stream_fails_alone_in_a_merged_forward() -> None:
    config = synthetic_config()
    counting = CountingBackend(SyntheticBackend(ModelConfig.model_validate(config), "cpu"))
    models, gated = gated_models(toy=fake_model(config, counting))
    runner, _ = make_runner(models)
    a, b = StreamState(), StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, a)
        runner.submit([poisoned(1, [1.0, POISON])], a)
        runner.submit([poisoned(1, [2.0, 3.0, 4.0])], b)
        gated.gate.set()
        [_, from_a] = await results(a, 2)
        [from_b] = await results(b, 1)
    finally:
        await runner.stop()
    assert counting.rows[0] == 5  # merged; then halves re-run until the poison is alone
    bad = items(from_a)[1].error
    assert (bad.code, bad.worker_fault, bad.reason) == (Code.INTERNAL, False, "model_error")
    assert values(from_a) == {0: 3.0}  # y = 2x + 1
    assert values(from_b) == {0: 5.0, 1: 7.0, 2: 9.0}


async def test_batches_merge_only_with_the_same_model_version_outputs_and_padded_shape() -> None:
    counters = {name: CountingBackend(RecordingBackend()) for name in ("v1", "v2", "other", "seq")}
    variable = [{"name": "x", "datatype": "FP32", "dims": [-1]}]
    seq_config = synthetic_config("seq", inputs=variable, outputs=[{**variable[0], "name": "y"}])
    seq_config.update(backend="torchscript", synthetic=None)  # a real backend may return variable dims
    v2 = fake_model(synthetic_config(), counters["v2"])
    models, gated = gated_models(
        v1=fake_model(synthetic_config(), counters["v1"]),
        v2=dataclasses.replace(v2, spec=dataclasses.replace(v2.spec, version="2")),
        other=fake_model(synthetic_config("other"), counters["other"]),
        seq=fake_model(seq_config, counters["seq"]),  # no buckets: only equal lengths stack
    )
    runner, _ = make_runner(models, capacity=16)
    stream = StreamState()
    waiting = [
        batch(1, [1]),
        batch(2, [1], version="2"),
        batch(3, [1], model="other"),
        batch(4, [1], outputs=["y"]),
        batch(5, [1], model="seq", width=3),
        batch(6, [1], model="seq", width=5),
        batch(7, [1, 2]),
        batch(8, [1], model="seq", width=3),
    ]
    runner.start()
    try:
        await hold_device(runner, gated, stream)
        for message in waiting:
            runner.submit([message], stream)
        gated.gate.set()
        answered = {r.batch_id: r for r in await results(stream, 1 + len(waiting))}
    finally:
        await runner.stop()
    assert {name: c.rows for name, c in counters.items()} == {
        "v1": [3, 1],  # batches 1 and 7 together; 4 asks for other outputs
        "v2": [1],
        "other": [1],
        "seq": [2, 1],  # batches 5 and 8 (length 3) together; 6 (length 5) alone
    }
    assert {i: answered[i].forward_rows for i in range(1, 9)} == {
        1: 3, 2: 1, 3: 1, 4: 1, 5: 2, 6: 1, 7: 3, 8: 2
    }  # fmt: skip


async def test_a_merged_forward_stays_within_max_batch_size() -> None:
    counting = CountingBackend(RecordingBackend())
    models, gated = gated_models(toy=fake_model(synthetic_config(max_batch_size=4), counting))
    runner, _ = make_runner(models)
    stream = StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, stream)
        for batch_id, ids in ((1, [1, 2, 3]), (2, [4, 5]), (3, [6])):
            runner.submit([batch(batch_id, ids)], stream)
        gated.gate.set()
        await results(stream, 4)
    finally:
        await runner.stop()
    assert counting.rows == [4, 2]  # 1 and 3 fit together (first fit); 2 runs next


async def test_at_capacity_a_batch_is_refused_at_once_and_never_executed() -> None:
    counting = CountingBackend(RecordingBackend())
    models, gated = gated_models(toy=fake_model(synthetic_config(), counting))
    runner, metrics = make_runner(models, capacity=2)
    a, b = StreamState(), StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, a)
        runner.submit([batch(1, [1, 2])], a)
        runner.submit([batch(1, [1, 2, 3])], b)  # a third batch, from another router
        [refused] = await results(b, 1)  # answered while the device is still held
        assert not gated.gate.is_set()
        gated.gate.set()
        [_, accepted] = await results(a, 2)
        runner.submit([batch(2, [1])], b)  # room again once answered
        [later] = await results(b, 1)
    finally:
        await runner.stop()
    assert refused.batch_id == 1 and [i.item_id for i in items(refused)] == [1, 2, 3]
    errors = {(i.error.code, i.error.reason, i.error.worker_fault) for i in items(refused)}
    assert errors == {(Code.UNAVAILABLE, WORKER_BUSY, False)}
    assert (refused.executed_size, refused.forward_rows, refused.queued_batches, refused.queued_rows) == (
        0, 0, 2, 3
    )  # fmt: skip
    assert counting.rows == [2, 1]  # the refused batch's rows never reached the device
    assert values(accepted) == {1: 2.0, 2: 3.0} and values(later) == {1: 2.0}
    assert sample(metrics, "sluice_worker_refused_batches_total", reason=WORKER_BUSY) == 1


async def test_every_answer_carries_the_queue_left_on_all_streams() -> None:
    other = fake_model(synthetic_config("other"), RecordingBackend())
    models, gated = gated_models(toy=fake_model(synthetic_config(), RecordingBackend()), other=other)
    runner, _ = make_runner(models)
    a, b = StreamState(), StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, a)
        runner.submit([batch(1, [1, 2])], a)
        runner.submit([batch(1, [1])], b)  # merges with a's batch 1
        runner.submit([batch(2, [1, 2, 3], model="other")], b)
        gated.gate.set()
        [held, merged_a] = await results(a, 2)
        [merged_b, last] = await results(b, 2)
    finally:
        await runner.stop()
    answers = (held, merged_a, merged_b, last)
    assert {(r.batch_id, len(items(r))): (r.queued_batches, r.queued_rows) for r in answers} == {
        (999, 1): (3, 6),  # the three batches behind the held one, on both streams
        (1, 2): (1, 3),  # the merged pair excluded: only `other` is left
        (1, 1): (1, 3),
        (2, 3): (0, 0),
    }


class ClockedBackend:
    """Each forward takes exactly 1 s of the fake clock (the device's time, simulated)."""

    name = "fake"

    def __init__(self, clock: FakeClock, inner: Backend) -> None:
        self._clock = clock
        self._inner = inner

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._clock.advance(1.0)
        return self._inner.forward(inputs)


async def test_busy_fraction_and_timings_follow_the_clock() -> None:
    clock = FakeClock(100.0)
    model = fake_model(synthetic_config(), ClockedBackend(clock, RecordingBackend()))
    runner, _ = make_runner({("toy", "1"): model}, clock=clock)
    assert runner.busy_fraction() == 0.0
    [result] = await run_batches(runner, batch(1, [1]), stream=StreamState())
    assert (result.queue_us, result.execute_us) == (0, 1_000_000)
    clock.advance(1.0)  # 1 s busy, then 1 s idle: 1/5 of the window, to within one 0.25 s slot
    assert 1 / 5 <= runner.busy_fraction() <= 1 / 4.75
    clock.advance(5.0)
    assert runner.busy_fraction() == 0.0


async def test_item_errors_say_whether_the_worker_is_to_blame_and_why() -> None:
    config = synthetic_config()
    working = fake_model(config, SyntheticBackend(ModelConfig.model_validate(config), "cpu"))
    broken = fake_model(synthetic_config("broken"), FailingBackend())
    models = {("toy", "1"): working, ("broken", "1"): broken}
    runner, _ = make_runner(models)
    only_bad = poisoned(1, [POISON, POISON])
    on_broken = batch(2, [1, 2], model="broken")
    unknown = batch(3, [1], model="absent")
    answered = await run_batches(runner, only_bad, on_broken, unknown, stream=StreamState())
    blame = {
        r.batch_id: [(i.error.code, i.error.worker_fault, i.error.reason) for i in items(r)] for r in answered
    }
    assert blame == {
        1: [(Code.INTERNAL, False, "model_error")] * 2,  # the model runs its canary: the client's doing
        2: [(Code.INTERNAL, True, "worker_fault")] * 2,  # the model fails its canary too: worker broken
        3: [(Code.NOT_FOUND, True, "not_found")],  # the router believed this worker serves it
    }


async def test_after_a_device_fault_only_the_faulted_forward_is_answered() -> None:
    simulated = synthetic_config(synthetic={"base_ms": 0, "per_item_ms": 0, "fault_trigger": 7.0})
    backend = CountingBackend(SyntheticBackend(ModelConfig.model_validate(simulated), "cpu"))
    untouched = CountingBackend(RecordingBackend())
    models, gated = gated_models(
        toy=fake_model(simulated, backend), other=fake_model(synthetic_config("other"), untouched)
    )
    faults: list[Internal] = []
    runner, _ = make_runner(models, on_device_fault=faults.append)
    stream = StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, stream)
        for message in (poisoned(1, [1.0, 7.0]), poisoned(2, [1.0]), poisoned(3, [2.0], model="other")):
            runner.submit([message], stream)
        gated.gate.set()
        [_, first, second] = await results(stream, 3)
        assert await runner.wait_idle(within_s=5)
    finally:
        await runner.stop()
    assert (first.batch_id, second.batch_id) == (1, 2)  # merged: both met the fault, both are answered
    for result in (first, second):
        assert {(i.error.code, i.error.worker_fault) for i in items(result)} == {(Code.INTERNAL, True)}
    assert "device-side assert" in items(first)[0].error.message
    assert len(faults) == 1 and faults[0].reason == "device_fault"
    assert stream.outbox.empty()  # batch 3 is never answered: routers re-dispatch it
    assert backend.rows == [3] and untouched.rows == []  # nor run: the device is never touched again
    assert runner.pending_batches == 0


async def test_cancels_are_kept_only_for_items_the_worker_holds_and_forgotten_once_answered() -> None:
    """A cancel that arrives after its item was answered, or for an id never sent, used to stay in the
    stream's state for the stream's lifetime: a router could grow it without bound."""
    models, gated = gated_models(toy=fake_model(synthetic_config(), RecordingBackend()))
    runner, _ = make_runner(models)
    stream = StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, stream)
        runner.submit([batch(1, [1, 2])], stream)
        stream.cancel([1, *range(10_000, 20_000)])  # one held item, and ids this worker never saw
        assert stream.cancelled == {1} and stream.held == {999, 1, 2}
        gated.gate.set()
        [_, result] = await results(stream, 2)
        stream.cancel([0, 2, 999])  # late: every one of them was answered already
    finally:
        await runner.stop()
    by_id = {item.item_id: item for item in items(result)}
    assert by_id[1].error.code == Code.CANCELLED and not by_id[2].failed
    assert stream.cancelled == set() and stream.held == set()


async def test_a_malformed_batch_fails_every_item_invalid_and_never_runs() -> None:
    backend = RecordingBackend()
    runner, _ = make_runner({("toy", "1"): fake_model(synthetic_config(), backend)})
    short = batch(1, [1, 2])
    short.inputs[0].data = short.inputs[0].data[:-4]  # the buffer disagrees with the items' shapes
    uneven = batch(2, [1, 2])
    del uneven.budgets_us[1:]
    answered = await run_batches(runner, short, uneven, stream=StreamState())
    for result in answered:
        errors = [(e.item_id, e.code, e.reason, e.worker_fault) for e in result.errors]
        assert errors == [
            (1, Code.INVALID_ARGUMENT, "bad_batch", False),
            (2, Code.INVALID_ARGUMENT, "bad_batch", False),
        ]
        assert not result.item_ids and not result.outputs
    assert backend.calls == []


async def test_the_answers_of_one_forward_to_one_stream_travel_in_one_message() -> None:
    models, gated = gated_models(toy=fake_model(synthetic_config(), RecordingBackend()))
    runner, _ = make_runner(models, capacity=3)
    stream = StreamState()
    runner.start()
    try:
        await hold_device(runner, gated, stream)
        runner.submit([batch(1, [1]), batch(2, [2, 3]), batch(3, [4])], stream)  # the third is one too many
        [refused] = (await asyncio.wait_for(stream.outbox.get(), 5)).results  # type: ignore[union-attr]
        gated.gate.set()
        await results(stream, 1)  # the held batch
        message = await asyncio.wait_for(stream.outbox.get(), 5)
    finally:
        await runner.stop()
    assert refused.batch_id == 3 and refused.errors[0].reason == WORKER_BUSY
    assert message is not None and [r.batch_id for r in message.results] == [1, 2]  # merged, one message
    assert [first_values(r) for r in message.results] == [{1: 2.0}, {2: 3.0, 3: 4.0}]
    assert [list(r.item_rows) for r in message.results] == [[1], [1, 1]]


async def test_items_of_different_lengths_in_one_batch_come_back_ragged() -> None:
    variable = [{"name": "x", "datatype": "FP32", "dims": [-1]}]
    seq = synthetic_config("seq", inputs=variable, outputs=[{**variable[0], "name": "y"}])
    seq.update(backend="torchscript", synthetic=None)  # a real backend may return variable dims
    counting = CountingBackend(RecordingBackend())
    runner, _ = make_runner({("seq", "1"): fake_model(seq, counting)})
    lengths = {1: 3, 2: 5, 3: 3}
    ragged = packed_batch(1, "seq", "1", [(i, {"x": np.full((1, n), i, "<f4")}) for i, n in lengths.items()])
    assert ragged.inputs[0].ragged
    [result] = await run_batches(runner, ragged, stream=StreamState())
    assert sorted(counting.rows) == [1, 2]  # no buckets: one forward per length
    assert result.outputs[0].ragged and result.executed_size == 3
    got = {view.item_id: view.outputs[0] for view in items(result)}
    for item_id, length in lengths.items():
        np.testing.assert_array_equal(got[item_id], np.full((1, length), item_id + 1, "<f4"))


async def test_forwards_on_the_loop_merge_answer_and_skip_as_on_the_device_thread() -> None:
    counting = CountingBackend(RecordingBackend())
    runner, metrics = make_runner(
        {("toy", "1"): fake_model(synthetic_config(), counting)}, forward_on_loop=True
    )
    a, b = StreamState(), StreamState()
    runner.start()
    try:
        runner.submit([batch(1, [1, 2]), batch(2, [3])], a)  # one stream message: both wait, then merge
        runner.submit([batch(1, [1], offset=10)], b)
        b.cancel([1])
        message = await asyncio.wait_for(a.outbox.get(), 5)
        [from_b] = await results(b, 1)
        assert await runner.wait_idle(within_s=5)
    finally:
        await runner.stop()
    assert counting.rows == [3]  # b's only item was cancelled before its forward: skipped, not run
    assert message is not None and [first_values(r) for r in message.results] == [{1: 2.0, 2: 3.0}, {3: 4.0}]
    assert [(e.item_id, e.code) for e in from_b.errors] == [(1, Code.CANCELLED)]
    assert sample(metrics, "sluice_worker_batches_total", model="toy") == 3


async def test_an_invalid_item_fails_alone_though_the_batch_is_checked_as_a_whole() -> None:
    ranged = synthetic_config(inputs=[{"name": "x", "datatype": "INT32", "dims": [4], "range": [0, 10]}])
    counting = CountingBackend(RecordingBackend())
    runner, _ = make_runner({("toy", "1"): fake_model(ranged, counting)})

    def tokens(batch_id: int, values: Sequence[int]) -> worker_pb2.Batch:
        rows = [(v, {"x": np.full((1, 4), v, "<i4")}) for v in values]
        return packed_batch(batch_id, "toy", "1", rows)

    in_range = tokens(1, [1, 2, 3])  # checked once for all three
    one_out = tokens(2, [4, 50, 6])  # 50 is out of range: only that item fails
    empty_item = tokens(3, [7, 8])
    empty_item.item_rows[1] = 0  # an item of no rows (the buffer holding only the other's row)
    empty_item.inputs[0].data = empty_item.inputs[0].data[:16]
    answered = await run_batches(runner, in_range, one_out, empty_item, stream=StreamState())
    assert [first_values(r) for r in answered] == [{1: 2.0, 2: 3.0, 3: 4.0}, {4: 5.0, 6: 7.0}, {7: 8.0}]
    errors = [[(e.item_id, e.code, e.reason) for e in r.errors] for r in answered]
    assert errors == [
        [],
        [(50, Code.INVALID_ARGUMENT, "out_of_range")],
        [(8, Code.INVALID_ARGUMENT, "bad_shape")],
    ]
    assert sum(counting.rows) == 6  # the two invalid items never reached the device
