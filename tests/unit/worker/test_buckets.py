"""Shape buckets with padding and masks (isolating failed items: test_isolation.py)."""

from __future__ import annotations

import time

import numpy as np
import torch

from sluice_inference.common.buckets import bucket_for
from sluice_inference.worker.backends.synthetic import SyntheticBackend
from sluice_inference.worker.executor import ExecItem, Executor, LoadedModel
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.padding import group_key
from tests.unit.worker.fakes import synthetic_config


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


def test_slowdown_scales_simulated_latency() -> None:
    config = ModelConfig.model_validate(synthetic_config("toy", synthetic={"base_ms": 20, "per_item_ms": 0}))
    x = {"x": torch.zeros((1, 4))}
    timings = []
    for slowdown in (1.0, 2.0):
        backend = SyntheticBackend(config, "cpu", slowdown)
        start = time.perf_counter()
        backend.forward(x)
        timings.append(time.perf_counter() - start)
    # time.sleep never returns early, so the lower bounds hold however busy the machine is; a slowdown that
    # were ignored would leave the second forward at ~20 ms, under its 40 ms bound.
    assert timings[0] >= 0.020
    assert timings[1] >= 0.040
