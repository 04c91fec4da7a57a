"""Executor: batched results equal per-item results, item-level errors, output filtering, forward
grouping, masks, warm-up, and the other backends (TorchScript, positional torch.export, synthetic)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sluice_inference.common.errors import Internal, InvalidArgument
from sluice_inference.worker.executor import ExecItem, Executor, ItemOutcome, LoadedModel, warmup_items
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.repository import scan_repository
from tests.unit.worker.fakes import (
    FailingBackend,
    RecordingBackend,
    WrongDtypeBackend,
    fake_model,
    synthetic_config,
    write_model,
)

RNG = np.random.default_rng(7)


def rows(n: int, width: int = 256) -> np.ndarray:
    return RNG.standard_normal((n, width)).astype(np.float32)


def ok(outcome: ItemOutcome) -> dict[str, np.ndarray]:
    assert outcome.error is None, outcome.error
    assert outcome.outputs is not None
    return outcome.outputs


def test_mlp_batched_equals_alone(executor: Executor, demo_models: dict[str, LoadedModel]) -> None:
    mlp = demo_models["mlp"]
    items = [ExecItem(i, {"input": rows(3 if i == 4 else 1)}) for i in range(9)]
    batched = executor.run(mlp, items)
    assert [o.item_id for o in batched] == list(range(9))
    for item, outcome in zip(items, batched, strict=True):
        alone = ok(executor.run(mlp, [item])[0])["output"]
        together = ok(outcome)["output"]
        assert together.shape == (item.inputs["input"].shape[0], 10)
        np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)
        assert together.base is not None  # a row slice of the forward's output: no copy per item


def test_encoder_batched_equals_alone(executor: Executor, demo_models: dict[str, LoadedModel]) -> None:
    encoder = demo_models["encoder"]
    lengths = [16, 16, 5, 16, 5, 128]  # two shape groups plus one; each runs as its own forward
    items = [ExecItem(i, {"tokens": RNG.integers(0, 1000, (1, n))}) for i, n in enumerate(lengths)]
    batched = executor.run(encoder, items, outputs=["embedding"])
    for item, outcome in zip(items, batched, strict=True):
        alone = ok(executor.run(encoder, [item])[0])["embedding"]
        np.testing.assert_allclose(ok(outcome)["embedding"], alone, atol=1e-5, rtol=0)


def test_bad_items_fail_alone(executor: Executor, demo_models: dict[str, LoadedModel]) -> None:
    mlp = demo_models["mlp"]
    items = [
        ExecItem(0, {"input": rows(1)}),
        ExecItem(1, {"input": rows(1).astype(np.float64)}),
        ExecItem(2, {"input": rows(1, width=255)}),
        ExecItem(3, {"inp": rows(1)}),
        ExecItem(4, {"input": rows(65)}),
        ExecItem(5, {"input": rows(1)[0]}),
        ExecItem(6, {"input": rows(2)}),
    ]
    outcomes = executor.run(mlp, items)
    assert [o.item_id for o in outcomes] == list(range(7))
    for bad, reason in zip(outcomes[1:6], ["FP32", "shape", "missing", "65 rows", "shape"], strict=True):
        assert isinstance(bad.error, InvalidArgument) and bad.outputs is None
        assert reason in bad.error.message
    assert ok(outcomes[0])["output"].shape == (1, 10)
    assert ok(outcomes[6])["output"].shape == (2, 10)


def test_encoder_length_beyond_largest_bucket(
    executor: Executor, demo_models: dict[str, LoadedModel]
) -> None:
    outcome = executor.run(demo_models["encoder"], [ExecItem(0, {"tokens": np.zeros((1, 129), np.int64)})])[0]
    assert isinstance(outcome.error, InvalidArgument) and "largest bucket 128" in outcome.error.message


def test_values_outside_a_declared_range_fail_alone(
    executor: Executor, demo_models: dict[str, LoadedModel]
) -> None:
    encoder = demo_models["encoder"]  # tokens: range [0, 999], the vocabulary
    lengths_and_peaks = [(5, 999), (5, 1000), (9, 0), (9, -1), (16, 2**40)]
    items = []
    for i, (length, peak) in enumerate(lengths_and_peaks):
        values = RNG.integers(0, 1000, (1, length))
        values[0, length // 2] = peak
        items.append(ExecItem(i, {"tokens": values}))
    outcomes = executor.run(encoder, items)
    for bad, peak in ((1, 1000), (3, -1), (4, 2**40)):
        error = outcomes[bad].error
        assert isinstance(error, InvalidArgument) and error.reason == "out_of_range"
        assert f"value {peak} is outside its range [0, 999]" in error.message
        assert not outcomes[bad].worker_fault
    assert ok(outcomes[0])["embedding"].shape == (1, 64) and ok(outcomes[2])["embedding"].shape == (1, 64)


def test_warm_up_inputs_respect_declared_ranges() -> None:
    inputs = [
        {"name": "a", "datatype": "INT32", "dims": [2], "range": [5, 9]},
        {"name": "b", "datatype": "INT32", "dims": [2], "range": [-9, -5]},
        {"name": "c", "datatype": "INT32", "dims": [2], "range": [-3, 3]},
        {"name": "d", "datatype": "FP32", "dims": [2]},
    ]
    config = ModelConfig.model_validate(synthetic_config(inputs=inputs))
    [item] = warmup_items(config, 1)
    firsts = {name: int(array[0, 0]) for name, array in item.inputs.items()}
    assert firsts == {"a": 5, "b": -5, "c": 0, "d": 0}


def test_requested_outputs_filter(executor: Executor) -> None:
    outputs = [{"name": n, "datatype": "FP32", "dims": [4]} for n in ("y", "z")]
    model = fake_model(synthetic_config(outputs=outputs), RecordingBackend(["y", "z"]))
    items = [ExecItem(0, {"x": np.ones((1, 4), np.float32)})]
    assert set(ok(executor.run(model, items)[0])) == {"y", "z"}
    assert set(ok(executor.run(model, items, outputs=["z"])[0])) == {"z"}
    unknown = executor.run(model, [*items, ExecItem(1, items[0].inputs)], outputs=["y", "w"])
    assert all(isinstance(o.error, InvalidArgument) and "'w'" in o.error.message for o in unknown)


def test_forward_error_fails_the_whole_forward(executor: Executor) -> None:
    model = fake_model(synthetic_config(), FailingBackend())
    items = [ExecItem(i, {"x": np.ones((1, 4), np.float32)}) for i in range(3)]
    items.append(ExecItem(3, {"x": np.ones((1, 5), np.float32)}))  # invalid: keeps its own error
    outcomes = executor.run(model, items)
    assert all(isinstance(o.error, Internal) and "boom" in o.error.message for o in outcomes[:3])
    assert isinstance(outcomes[3].error, InvalidArgument)


def test_output_not_matching_config_is_internal(executor: Executor) -> None:
    model = fake_model(synthetic_config(), WrongDtypeBackend())
    outcome = executor.run(model, [ExecItem(0, {"x": np.ones((1, 4), np.float32)})])[0]
    assert isinstance(outcome.error, Internal) and "float64" in outcome.error.message
    assert outcome.worker_fault  # the canary's outputs are wrong too: the model is broken, not the item


def test_groups_respect_max_batch_size(executor: Executor) -> None:
    backend = RecordingBackend()
    model = fake_model(synthetic_config(max_batch_size=8), backend)
    items = [ExecItem(i, {"x": np.full((3, 4), i, np.float32)}) for i in range(5)]  # 15 rows
    outcomes = executor.run(model, items)
    assert [call["x"].shape[0] for call in backend.calls] == [6, 6, 3]
    for i, outcome in enumerate(outcomes):
        np.testing.assert_array_equal(ok(outcome)["y"], np.full((3, 4), i + 1, np.float32))


@pytest.mark.parametrize(
    ("item_rows", "forwards"),
    [
        ([2, 3, 3], [8]),  # exactly max_batch_size: one forward
        ([2, 3, 3, 1], [8, 1]),  # one row more: the last item starts the next
        ([7, 1, 1], [8, 1]),
        ([1] * 9, [8, 1]),
    ],
)
def test_items_of_one_shape_share_a_forward_exactly_up_to_max_batch_size(
    executor: Executor, item_rows: list[int], forwards: list[int]
) -> None:
    backend = RecordingBackend()
    model = fake_model(synthetic_config(max_batch_size=8), backend)
    items = [ExecItem(i, {"x": np.full((n, 4), i, np.float32)}) for i, n in enumerate(item_rows)]
    outcomes = executor.run(model, items)
    assert [call["x"].shape[0] for call in backend.calls] == forwards
    for i, (n, outcome) in enumerate(zip(item_rows, outcomes, strict=True)):
        np.testing.assert_array_equal(ok(outcome)["y"], np.full((n, 4), i + 1, np.float32))


def _bucketed_config(**overrides: Any) -> dict[str, Any]:
    """One variable FP32 input `x` bucketed to 4 or 16 (a row costs its bucket), max_batch_cost 32."""
    variable = [{"name": "x", "datatype": "FP32", "dims": [-1]}]
    return synthetic_config(
        backend="torch_export",
        synthetic=None,
        inputs=variable,
        outputs=[{**variable[0], "name": "y"}],
        batching={"buckets": {"x": [4, 16]}, "max_batch_cost": 32},
        **overrides,
    )


@pytest.mark.parametrize(("count", "forwards"), [(8, [(8, 4)]), (9, [(8, 4), (1, 4)])])
def test_items_of_one_padded_shape_share_a_forward_exactly_up_to_max_batch_cost(
    executor: Executor, count: int, forwards: list[tuple[int, int]]
) -> None:
    config = _bucketed_config(max_batch_size=16)
    backend = RecordingBackend()
    items = [ExecItem(i, {"x": np.zeros((1, 2 + i % 2), np.float32)}) for i in range(count)]  # cost 4 a row
    assert all(o.error is None for o in executor.run(fake_model(config, backend), items))
    assert [tuple(call["x"].shape) for call in backend.calls] == forwards


def test_groups_respect_max_batch_cost_per_padded_shape(executor: Executor) -> None:
    config = _bucketed_config()
    backend = RecordingBackend()
    lengths = [3, 10, 3, 10, 3, 10, 3, 3]  # bucket 4 costs 4 a row (8 rows fit), bucket 16 costs 16 (2)
    items = [ExecItem(i, {"x": np.zeros((1, n), np.float32)}) for i, n in enumerate(lengths)]
    assert all(o.error is None for o in executor.run(fake_model(config, backend), items))
    assert [tuple(call["x"].shape) for call in backend.calls] == [(5, 4), (2, 16), (1, 16)]


def test_mask_input_is_supplied(executor: Executor) -> None:
    config = synthetic_config(
        backend="torch_export",
        synthetic=None,
        inputs=[{"name": "tokens", "datatype": "INT64", "dims": [-1]}],
        outputs=[{"name": "y", "datatype": "FP32", "dims": [-1]}],
        batching={"mask_input": "mask"},
    )
    backend = RecordingBackend()
    items = [ExecItem(i, {"tokens": np.zeros((1, 6), np.int64)}) for i in range(2)]
    executor.run(fake_model(config, backend), items)
    mask = backend.calls[0]["mask"]
    assert mask.dtype == torch.float32 and tuple(mask.shape) == (2, 6) and bool(mask.eq(1).all())


def test_warm_up(executor: Executor, demo_models: dict[str, LoadedModel]) -> None:
    for model in demo_models.values():
        executor.warm_up(model)
    backend = RecordingBackend()
    executor.warm_up(fake_model(synthetic_config(max_batch_size=8), backend))
    assert [call["x"].shape[0] for call in backend.calls] == [1, 8]
    with pytest.raises(Internal, match="warm-up of 'toy' v1 at batch 1"):
        executor.warm_up(fake_model(synthetic_config(), FailingBackend()))


def test_synthetic_output_and_simulated_latency(
    executor: Executor, demo_models: dict[str, LoadedModel]
) -> None:
    model = demo_models["synthetic"]  # SIMULATED: base 5 ms + 0.5 ms per row

    def timed(n: int) -> float:
        items = [ExecItem(i, {"x": np.full((1, 16), i, np.float32)}) for i in range(n)]
        start = time.perf_counter()
        outcomes = executor.run(model, items)
        elapsed = time.perf_counter() - start
        for i, outcome in enumerate(outcomes):
            np.testing.assert_array_equal(ok(outcome)["y"], np.full((1, 16), 2 * i + 1, np.float32))
        return elapsed

    one, full = timed(1), timed(32)
    assert one >= 0.0055 and full >= 0.021  # sleep never returns early
    assert full > one


def test_torchscript_backend(tmp_path: Path, executor: Executor) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3).eval()
    config = synthetic_config(
        backend="torchscript", synthetic=None, outputs=[{"name": "y", "datatype": "FP32", "dims": [3]}]
    )
    folder = write_model(tmp_path, config)

    class Named(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.inner(x)
            return out

    with pytest.warns(DeprecationWarning):
        traced = torch.jit.trace(Named(), torch.zeros(2, 4))  # type: ignore[no-untyped-call]
        torch.jit.save(traced, str(folder / "1" / "model.pt"))
    with pytest.warns(DeprecationWarning):
        model = executor.load(scan_repository(tmp_path)[0])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y = ok(executor.run(model, [ExecItem(0, {"x": x})])[0])
    with torch.no_grad():
        np.testing.assert_allclose(y["y"], module(torch.from_numpy(x)).numpy(), atol=1e-6)


def test_positionally_exported_program(tmp_path: Path, executor: Executor) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(module, (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
    folder = write_model(tmp_path, synthetic_config(backend="torch_export", synthetic=None))
    torch.export.save(program, folder / "1" / "model.pt2")
    model = executor.load(scan_repository(tmp_path)[0])
    x = np.ones((1, 4), np.float32)
    y = ok(executor.run(model, [ExecItem(0, {"x": x})])[0])["y"]
    with torch.no_grad():
        np.testing.assert_allclose(y, module(torch.from_numpy(x)).numpy(), atol=1e-6)
