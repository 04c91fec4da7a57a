"""TorchScript binding: Triton's INPUT__i / OUTPUT__i by position, other names by keyword, and a config
that does not fit the module refused at load with the module's real signature."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sluice_inference.worker.executor import ExecItem, Executor
from sluice_inference.worker.repository import RepositoryError, scan_repository
from tests.unit.worker.fakes import synthetic_config, write_model

A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.full((2, 3), 10, dtype=np.float32)


class SumAndDifference(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


def _tensor(name: str) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "dims": [3]}


def _write(root: Path, inputs: list[str], outputs: list[str]) -> None:
    config = synthetic_config(
        "ts", backend="torchscript", synthetic=None,
        inputs=[_tensor(n) for n in inputs], outputs=[_tensor(n) for n in outputs],
    )  # fmt: skip
    folder = write_model(root, config)
    traced = torch.jit.trace(SumAndDifference(), (torch.zeros(2, 3), torch.zeros(2, 3)))  # type: ignore[no-untyped-call]
    torch.jit.save(traced, str(folder / "1" / "model.pt"))


def _run(root: Path, executor: Executor, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    model = executor.load(scan_repository(root)[0])
    [outcome] = executor.run(model, [ExecItem(0, inputs)])
    assert outcome.error is None and outcome.outputs is not None, outcome.error
    return outcome.outputs


def test_triton_names_bind_by_position_whatever_their_config_order(
    tmp_path: Path, executor: Executor
) -> None:
    _write(tmp_path, ["INPUT__1", "INPUT__0"], ["OUTPUT__1", "OUTPUT__0"])
    out = _run(tmp_path, executor, {"INPUT__0": A, "INPUT__1": B})
    np.testing.assert_array_equal(out["OUTPUT__0"], A + B)
    np.testing.assert_array_equal(out["OUTPUT__1"], A - B)


def test_other_names_bind_by_keyword(tmp_path: Path, executor: Executor) -> None:
    _write(tmp_path, ["b", "a"], ["sum", "difference"])
    out = _run(tmp_path, executor, {"a": A, "b": B})
    np.testing.assert_array_equal(out["sum"], A + B)
    np.testing.assert_array_equal(out["difference"], A - B)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (["input", "b"], "no parameter ['input']"),
        (["a"], "nothing for ['b']"),
        (["INPUT__0", "b"], "mix positional names"),
        (["INPUT__0", "INPUT__2"], "exactly 0..1"),
        (["INPUT__0"], "1 positional input(s) do not fit"),
    ],
)
def test_a_config_that_does_not_fit_names_the_real_signature(
    tmp_path: Path, inputs: list[str], message: str
) -> None:
    _write(tmp_path, inputs, ["OUTPUT__0"])
    with pytest.raises(RepositoryError) as info:
        Executor().load(scan_repository(tmp_path)[0])
    assert message in str(info.value)
    assert "forward(a: Tensor, b: Tensor)" in str(info.value)
    assert str(tmp_path / "ts" / "1" / "model.pt") in str(info.value)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(4, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.relu(self.hidden(x)))
        return out


def _mlp_repository(root: Path, **config: Any) -> Path:
    """A repository with one scripted MLP `mlp` (x FP32[4] → y FP32[3]); returns its artifact."""
    y = {"name": "y", "datatype": "FP32", "dims": [3]}
    settings = synthetic_config("mlp", backend="torchscript", synthetic=None, outputs=[y], **config)
    folder = write_model(root, settings)
    torch.manual_seed(0)
    artifact = folder / "1" / "model.pt"
    torch.jit.save(torch.jit.script(Mlp()), str(artifact))
    return artifact


def test_a_module_runs_frozen_for_inference_and_answers_as_loaded(tmp_path: Path, executor: Executor) -> None:
    artifact = _mlp_repository(tmp_path)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    model = executor.load(scan_repository(tmp_path)[0])
    assert getattr(model.backend, "frozen", None) is True
    outcomes = executor.run(model, [ExecItem(i, {"x": x[i : i + 1]}) for i in range(5)])
    with torch.inference_mode():
        expected = torch.jit.load(str(artifact)).eval()(torch.from_numpy(x)).numpy()  # type: ignore[no-untyped-call]
    got = np.concatenate([o.outputs["y"] for o in outcomes if o.outputs is not None])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_freeze_false_serves_the_module_as_loaded(tmp_path: Path, executor: Executor) -> None:
    _mlp_repository(tmp_path, freeze=False)
    model = executor.load(scan_repository(tmp_path)[0])
    assert getattr(model.backend, "frozen", None) is False


def test_a_module_torch_cannot_freeze_is_served_as_loaded(
    tmp_path: Path, executor: Executor, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    artifact = _mlp_repository(tmp_path)

    def cannot(module: torch.jit.ScriptModule) -> torch.jit.ScriptModule:
        raise RuntimeError("freezing is not supported for this module")

    monkeypatch.setattr(torch.jit, "freeze", cannot)
    with caplog.at_level(logging.WARNING, logger="sluice_inference.worker.backends.torchscript"):
        model = executor.load(scan_repository(tmp_path)[0])
    assert getattr(model.backend, "frozen", None) is False
    assert f"serving {artifact} as loaded" in caplog.text
    [outcome] = executor.run(model, [ExecItem(0, {"x": np.ones((1, 4), np.float32)})])
    assert outcome.error is None and outcome.outputs is not None
    assert outcome.outputs["y"].shape == (1, 3)
