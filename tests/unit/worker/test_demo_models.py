"""Demo repository: loadable, faithful to the eager modules, padding-independent, and reproducible."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice_inference.worker.backends.torch_export import TorchExportBackend
from sluice_inference.worker.demo_models import build_encoder, build_mlp, init_demo_repository
from sluice_inference.worker.executor import ExecItem, Executor, LoadedModel
from sluice_inference.worker.repository import scan_repository


def file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_init_creates_loadable_models(demo_repo: Path, demo_models: dict[str, LoadedModel]) -> None:
    specs = scan_repository(demo_repo)
    assert [(s.name, s.version, s.config.backend) for s in specs] == [
        ("encoder", "1", "torch_export"),
        ("mlp", "1", "torch_export"),
        ("mlp_onnx", "1", "onnxruntime"),
        ("synthetic", "1", "synthetic"),
    ]
    assert set(demo_models) == {"encoder", "mlp", "mlp_onnx", "synthetic"}
    mlp = demo_models["mlp"].spec.config
    assert (mlp.max_batch_size, mlp.deterministic, mlp.cache) == (64, True, "enabled")
    assert "SIMULATED" in (demo_repo / "synthetic" / "config.yaml").read_text()
    [tokens] = demo_models["encoder"].record.inputs
    assert tokens.range == (0, 999)  # the vocabulary: routers and the worker refuse other ids


@pytest.mark.parametrize("batch", [1, 32, 64])
def test_exported_mlp_matches_eager(demo_repo: Path, batch: int) -> None:
    exported = torch.export.load(demo_repo / "mlp" / "1" / "model.pt2").module()
    x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(batch))
    with torch.inference_mode():
        torch.testing.assert_close(exported(input=x), build_mlp()(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("batch", "length"), [(1, 1), (1, 16), (32, 128)])
def test_exported_encoder_matches_eager(demo_repo: Path, batch: int, length: int) -> None:
    exported = torch.export.load(demo_repo / "encoder" / "1" / "model.pt2").module()
    tokens = torch.randint(0, 1000, (batch, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones(batch, length)
    with torch.inference_mode():
        expected = build_encoder()(tokens, mask)
        torch.testing.assert_close(exported(tokens=tokens, mask=mask), expected, atol=1e-5, rtol=0)


def test_encoder_ignores_masked_padding(demo_models: dict[str, LoadedModel]) -> None:
    backend = demo_models["encoder"].backend
    tokens = torch.randint(1, 1000, (1, 10), generator=torch.Generator().manual_seed(3))
    padded = torch.randint(1, 1000, (1, 32), generator=torch.Generator().manual_seed(4))  # junk beyond 10
    padded[:, :10] = tokens
    mask = torch.zeros(1, 32)
    mask[:, :10] = 1
    with torch.inference_mode():
        alone = backend.forward({"tokens": tokens, "mask": torch.ones(1, 10)})["embedding"]
        in_bucket = backend.forward({"tokens": padded, "mask": mask})["embedding"]
    torch.testing.assert_close(in_bucket, alone, atol=1e-5, rtol=0)


def test_executor_serves_demo_mlp_like_eager(executor: Executor, demo_models: dict[str, LoadedModel]) -> None:
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    outcomes = executor.run(demo_models["mlp"], [ExecItem(i, {"input": x[i : i + 1]}) for i in range(4)])
    got = np.concatenate([o.outputs["output"] for o in outcomes if o.outputs is not None])
    with torch.inference_mode():
        np.testing.assert_allclose(got, build_mlp()(torch.from_numpy(x)).numpy(), atol=1e-5, rtol=0)


def test_init_is_reproducible(demo_repo: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    folders = init_demo_repository(again)
    assert folders == [again / "mlp", again / "encoder", again / "synthetic", again / "mlp_onnx"]
    assert file_hashes(again) == file_hashes(demo_repo)  # byte-identical, .pt2 archives included
    init_demo_repository(again)  # overwriting in place changes nothing either
    assert file_hashes(again) == file_hashes(demo_repo)


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_onnx_mlp_answers_as_the_torch_mlp(
    executor: Executor, demo_models: dict[str, LoadedModel], batch: int
) -> None:
    x = np.random.default_rng(batch).standard_normal((batch, 256)).astype(np.float32)
    items = [ExecItem(0, {"input": x})]
    [onnx] = executor.run(demo_models["mlp_onnx"], items)
    [torch_export] = executor.run(demo_models["mlp"], items)
    assert onnx.outputs is not None and torch_export.outputs is not None
    np.testing.assert_allclose(onnx.outputs["output"], torch_export.outputs["output"], atol=1e-5, rtol=0)
    with torch.inference_mode():
        eager = build_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(onnx.outputs["output"], eager, atol=1e-5, rtol=0)
    spec = demo_models["mlp_onnx"].spec
    assert (spec.config.deterministic, spec.config.cache, spec.warnings) == (True, "enabled", ())
    assert spec.digest != demo_models["mlp"].spec.digest


def test_exported_backend_checks_the_call_once_and_the_guards_always(demo_repo: Path) -> None:
    [spec] = scan_repository(demo_repo, ["mlp"])
    backend = TorchExportBackend(demo_repo / "mlp" / "1" / "model.pt2", "cpu", ["output"])
    too_many = spec.config.max_batch_size + 1
    with torch.inference_mode():
        with pytest.raises(ValueError, match="keyword mismatch"):  # not the exported structure: said so
            backend.forward({"x": torch.zeros(1, 256)})
        backend.forward({"input": torch.zeros(1, 256)})
        with pytest.raises(AssertionError, match="Guard failed"):  # the graph's own guards still hold
            backend.forward({"input": torch.zeros(too_many, 256)})
        with pytest.raises(AssertionError, match="Guard failed"):
            backend.forward({"input": torch.zeros(1, 255)})
        [output] = backend.forward({"input": torch.zeros(2, 256)}).values()
    assert output.shape == (2, 10)
