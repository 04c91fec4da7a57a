"""ONNX Runtime backend: answers as the graph does in ONNX Runtime itself, reshapes between client dims and
the graph's shapes, and refuses at load a config that does not fit the graph (naming the graph's real
inputs and outputs) or a device the model cannot use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper

from sluice_inference.worker.backends import load_backend
from sluice_inference.worker.backends.onnx_runtime import GraphMismatch, providers
from sluice_inference.worker.demo_onnx import mlp_onnx_bytes
from sluice_inference.worker.executor import ExecItem, Executor, LoadedModel
from sluice_inference.worker.repository import RepositoryError, scan_repository
from tests.support.triton_repo import WIDTH_IN, WIDTH_OUT, small_mlp
from tests.unit.worker.fakes import synthetic_config


def _tensor(name: str, dims: list[int], **extra: Any) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "dims": dims, **extra}


def _write(
    root: Path, artifact: bytes, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]], **extra: Any
) -> None:
    config = synthetic_config(
        "g", backend="onnxruntime", synthetic=None, inputs=inputs, outputs=outputs, **extra
    )
    folder = root / "g"
    (folder / "1").mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "1" / "model.onnx").write_bytes(artifact)


def _in_onnxruntime(artifact: bytes, x: np.ndarray) -> np.ndarray:
    result: np.ndarray = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"]).run(
        None, {"input": x}
    )[0]
    return result


def _load(root: Path, executor: Executor) -> LoadedModel:
    model = executor.load(scan_repository(root)[0])
    executor.warm_up(model)
    return model


def test_batched_answers_equal_onnxruntime_alone(tmp_path: Path, executor: Executor) -> None:
    artifact = mlp_onnx_bytes(small_mlp(seed=3))
    _write(tmp_path, artifact, [_tensor("input", [WIDTH_IN])], [_tensor("output", [WIDTH_OUT])])
    model = _load(tmp_path, executor)
    rows = np.random.default_rng(0).standard_normal((5, WIDTH_IN)).astype(np.float32)
    outcomes = executor.run(model, [ExecItem(i, {"input": rows[i : i + 1]}) for i in range(5)])
    got = np.concatenate([o.outputs["output"] for o in outcomes if o.outputs is not None])
    np.testing.assert_allclose(got, _in_onnxruntime(artifact, rows), atol=1e-6, rtol=0)


def test_reshape_between_client_dims_and_the_graph(tmp_path: Path, executor: Executor) -> None:
    artifact = mlp_onnx_bytes(small_mlp(seed=4))
    inputs = [_tensor("input", [4, 4], reshape=[WIDTH_IN])]
    _write(tmp_path, artifact, inputs, [_tensor("output", [2, 2], reshape=[WIDTH_OUT])])
    model = _load(tmp_path, executor)
    x = np.random.default_rng(1).standard_normal((3, 4, 4)).astype(np.float32)
    [outcome] = executor.run(model, [ExecItem(0, {"input": x})])
    assert outcome.outputs is not None, outcome.error
    expected = _in_onnxruntime(artifact, x.reshape(3, WIDTH_IN)).reshape(3, 2, 2)
    np.testing.assert_allclose(outcome.outputs["output"], expected, atol=1e-6, rtol=0)


def _fixed_batch_identity() -> bytes:
    value = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, WIDTH_IN])
    out = helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, WIDTH_IN])
    graph = helper.make_graph([helper.make_node("Identity", ["input"], ["output"])], "fixed", [value], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data: bytes = model.SerializeToString()
    return data


@pytest.mark.parametrize(
    ("artifact", "inputs", "outputs", "message"),
    [
        (None, [_tensor("x", [WIDTH_IN])], [_tensor("output", [WIDTH_OUT])],
         "input 'x' is not in the model's graph: inputs input: float[batch, 16] -> outputs output: "
         "float[batch, 4]"),
        (None, [{"name": "input", "datatype": "FP64", "dims": [WIDTH_IN]}], [_tensor("output", [WIDTH_OUT])],
         "input 'input' is FP64 in the config, tensor(float) in the graph"),
        (None, [_tensor("input", [WIDTH_IN])], [_tensor("y", [WIDTH_OUT])],
         "output 'y' is not in the model's graph"),
        (_fixed_batch_identity(), [_tensor("input", [WIDTH_IN])], [_tensor("output", [WIDTH_IN])],
         "fixed batch dim 1 < max_batch_size 8"),
    ],
)  # fmt: skip
def test_a_config_that_does_not_fit_the_graph_is_refused(
    tmp_path: Path,
    artifact: bytes | None,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    message: str,
) -> None:
    _write(tmp_path, artifact or mlp_onnx_bytes(small_mlp(seed=5)), inputs, outputs)
    with pytest.raises(RepositoryError) as info:
        Executor().load(scan_repository(tmp_path)[0])
    assert message in str(info.value)
    assert "model.onnx: cannot load with onnxruntime" in str(info.value)


def test_device_kind_against_the_workers_device(tmp_path: Path) -> None:
    artifact = mlp_onnx_bytes(small_mlp(seed=6))
    _write(tmp_path, artifact, [_tensor("input", [WIDTH_IN])], [_tensor("output", [WIDTH_OUT])], device="gpu")
    with pytest.raises(RepositoryError, match=r"needs a CUDA worker, this one has cpu"):
        load_backend(scan_repository(tmp_path)[0], "cpu")


def test_providers_follow_the_device_and_fall_back_only_for_auto() -> None:
    cpu_only = ["CPUExecutionProvider"]
    both = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers(both, "cpu", "auto") == ["CPUExecutionProvider"]
    assert providers(both, "cuda:1", "gpu") == [
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    assert providers(cpu_only, "cuda:0", "auto") == ["CPUExecutionProvider"]  # Triton's KIND_AUTO fallback
    with pytest.raises(GraphMismatch, match="install onnxruntime-gpu"):
        providers(cpu_only, "cuda:0", "gpu")
