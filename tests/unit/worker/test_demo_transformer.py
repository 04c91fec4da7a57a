"""Transformer demo (`sluice models init --gpu`), at the tiny shape: every model loads and warms up
through the worker's executor, a row's output does not depend on its batch or padding, the half-precision
variants answer FP32 close to FP32, and `device: gpu` keeps them off CPU workers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice_inference.worker.demo_transformer import TINY, init_gpu_repository
from sluice_inference.worker.executor import ExecItem, Executor, LoadedModel
from sluice_inference.worker.repository import RepositoryError, scan_repository


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = tmp_path_factory.mktemp("gpu-demo")
    init_gpu_repository(root, TINY, half_device="auto")
    executor = Executor("cpu")
    loaded = {}
    for spec in scan_repository(root):
        model = executor.load(spec)
        executor.warm_up(model)
        loaded[spec.name] = model
    return loaded


def tokens(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, TINY.vocab, size=(1, length), dtype=np.int64)


def pooled(executor: Executor, model: LoadedModel, rows: list[np.ndarray]) -> list[np.ndarray]:
    outcomes = executor.run(model, [ExecItem(i, {"tokens": row}) for i, row in enumerate(rows)])
    results = []
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        assert outcome.outputs is not None
        results.append(outcome.outputs["pooled"])
    return results


def test_repository_holds_bert_and_its_half_variants(tiny_models: dict[str, LoadedModel]) -> None:
    assert sorted(tiny_models) == ["bert", "bert_bf16", "bert_fp16"]
    config = tiny_models["bert"].spec.config
    assert config.backend == "torchscript"
    assert config.batching.buckets == {"tokens": TINY.buckets}
    assert [t.dims for t in config.outputs] == [(TINY.hidden,)]


def test_a_rows_output_ignores_its_batch_and_padding(tiny_models: dict[str, LoadedModel]) -> None:
    executor = Executor("cpu")
    rows = [tokens(n, seed) for seed, n in enumerate((3, 7, 5, 8))]  # all pad to the bucket of 8
    batched = pooled(executor, tiny_models["bert"], rows)
    for row, together in zip(rows, batched, strict=True):
        [alone] = pooled(executor, tiny_models["bert"], [row])
        assert together.shape == (1, TINY.hidden) and together.dtype == np.float32
        np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "tolerance"), [("bert_fp16", 2e-3), ("bert_bf16", 2e-2)])
def test_half_variants_answer_fp32_close_to_fp32(
    tiny_models: dict[str, LoadedModel], name: str, tolerance: float
) -> None:
    executor = Executor("cpu")
    rows = [tokens(n, 10 + n) for n in (4, 16, 30)]
    full = pooled(executor, tiny_models["bert"], rows)
    half = pooled(executor, tiny_models[name], rows)
    for a, b in zip(full, half, strict=True):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, atol=tolerance, rtol=0)


def test_half_variants_are_for_cuda_workers_only(tmp_path: Path) -> None:
    init_gpu_repository(tmp_path, TINY)
    specs = {spec.name: spec for spec in scan_repository(tmp_path)}
    assert specs["bert_fp16"].config.device == "gpu"
    executor = Executor("cpu")
    with pytest.raises(RepositoryError, match="needs a CUDA worker"):
        executor.load(specs["bert_bf16"])
    assert executor.load(specs["bert"]).backend.name == "torchscript"
