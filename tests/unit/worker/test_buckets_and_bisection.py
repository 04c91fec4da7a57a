"""Shape buckets with padding and masks, and bisection that fails only the poison item."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from common.buckets import bucket_for
from common.errors import Code
from tests.unit.worker.fakes import fake_model, synthetic_config
from worker.backends.synthetic import POISON, SyntheticBackend
from worker.executor import ExecItem, Executor, LoadedModel
from worker.model_config import ModelConfig
from worker.padding import group_key


def tokens(item_id: int, length: int, seed: int) -> ExecItem:
    values = np.random.default_rng(seed).integers(1, 1000, size=(1, length)).astype("<i8")
    return ExecItem(item_id, {"tokens": values})


def test_bucket_is_the_smallest_that_fits() -> None:
    assert [bucket_for(n, (16, 32, 64)) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    assert bucket_for(7, ()) == 7


def test_padded_batch_gives_each_row_its_alone_output(
    demo_models: dict[str, LoadedModel], executor: Executor
) -> None:
    encoder = demo_models["encoder"]
    items = [tokens(i, length, seed=i) for i, length in enumerate((3, 9, 16, 11))]
    config = encoder.spec.config
    assert len({group_key(config, item.inputs) for item in items}) == 1  # all in the 16-bucket
    together = executor.run(encoder, items)
    for item, outcome in zip(items, together, strict=True):
        [alone] = executor.run(encoder, [item])
        assert outcome.outputs is not None and alone.outputs is not None
        np.testing.assert_allclose(outcome.outputs["embedding"], alone.outputs["embedding"], atol=1e-5)


def test_different_buckets_never_share_a_forward(demo_models: dict[str, LoadedModel]) -> None:
    config = demo_models["encoder"].spec.config
    assert group_key(config, tokens(0, 15, 0).inputs) != group_key(config, tokens(1, 17, 1).inputs)


def test_a_poison_item_fails_alone_within_a_bounded_number_of_forwards(tmp_path: Path) -> None:
    config = ModelConfig.model_validate(synthetic_config("toy", max_batch_size=16))
    backend = SyntheticBackend(config, "cpu")
    calls = []
    original = backend.forward

    def counting(inputs):  # type: ignore[no-untyped-def]
        calls.append(len(next(iter(inputs.values()))))
        return original(inputs)

    backend.forward = counting  # type: ignore[method-assign]
    model = fake_model(synthetic_config("toy", max_batch_size=16), backend)
    items = [ExecItem(i, {"x": np.full((1, 4), float(i), "<f4")}) for i in range(16)]
    items[11] = ExecItem(11, {"x": np.full((1, 4), POISON, "<f4")})
    outcomes = Executor().run(model, items)
    failed = [o.item_id for o in outcomes if o.error is not None]
    assert failed == [11]
    assert outcomes[11].error is not None and outcomes[11].error.code == Code.INTERNAL
    np.testing.assert_array_equal(outcomes[3].outputs["y"], np.full((1, 4), 7.0, "<f4"))  # type: ignore[index]
    assert len(calls) - 1 <= 2 * 4 + 2  # extra forwards bounded by 2·log2(16) + 2


def test_slowdown_scales_simulated_latency() -> None:
    config = ModelConfig.model_validate(synthetic_config("toy", synthetic={"base_ms": 20, "per_item_ms": 0}))
    x = {"x": torch.zeros((1, 4))}
    timings = []
    for slowdown in (1.0, 2.0):
        backend = SyntheticBackend(config, "cpu", slowdown)
        start = time.perf_counter()
        backend.forward(x)
        timings.append(time.perf_counter() - start)
    assert timings[1] > 1.5 * timings[0]
