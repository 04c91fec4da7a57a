"""Fakes of the worker's seams for unit tests: backends that record, fail or misbehave, and a helper that
writes model folders, so tests build exactly the repository they need in a tmp dir."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from sluice_inference.worker.backends import Backend
from sluice_inference.worker.executor import LoadedModel
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.repository import ModelVersionSpec


def synthetic_config(name: str = "toy", **overrides: Any) -> dict[str, Any]:
    """A valid synthetic-backend config dict with zero latency; `overrides` replace top-level keys."""
    config: dict[str, Any] = {
        "name": name,
        "backend": "synthetic",
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}],
        "max_batch_size": 8,
        "synthetic": {"base_ms": 0, "per_item_ms": 0},
    }
    config.update(overrides)
    return config


def write_model(
    root: Path, config: dict[str, Any], versions: Sequence[int | str] = (1,), artifact: bytes | None = None
) -> Path:
    """Write `root/<name>/config.yaml` and version folders (with `artifact` bytes under the backend's file
    name when given); returns the model folder."""
    folder: Path = root / str(config["name"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    filename = {"torch_export": "model.pt2", "torchscript": "model.pt"}.get(config["backend"])
    for version in versions:
        (folder / str(version)).mkdir(exist_ok=True)
        if artifact is not None and filename is not None:
            (folder / str(version) / filename).write_bytes(artifact)
    return folder


def spec_for(config: dict[str, Any]) -> ModelVersionSpec:
    """A version spec for `config` without touching disk (for fake backends)."""
    parsed = ModelConfig.model_validate(config)
    return ModelVersionSpec(parsed.name, "1", parsed, None, "sha256:" + "0" * 64)


class RecordingBackend:
    """Returns y = x + 1 for every output (cast to FP32) and remembers each batch it was given."""

    name = "fake"

    def __init__(self, output_names: Sequence[str] = ("y",)) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        self._output_names = tuple(output_names)

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Record the batch and compute x + 1 from the first input."""
        self.calls.append(dict(inputs))
        first = next(iter(inputs.values()))
        return {name: first.to(torch.float32) + 1 for name in self._output_names}


class CountingBackend:
    """Wraps a backend and records the rows of every forward it is asked to run, in order."""

    name = "fake"

    def __init__(self, inner: Backend) -> None:
        self.rows: list[int] = []
        self._inner = inner

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Record the batch's rows, then run the wrapped backend."""
        self.rows.append(int(next(iter(inputs.values())).shape[0]))
        return self._inner.forward(inputs)


class GatedBackend:
    """Wraps a backend; every forward first says it started, then waits until the test opens the gate
    (at most 5 s), so a test can hold the device busy while it submits more batches."""

    name = "fake"

    def __init__(self, inner: Backend) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self._inner = inner

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Signal the start, wait for the gate, then run the wrapped backend."""
        self.started.set()
        if not self.gate.wait(5):
            raise TimeoutError("the test never opened the gate")
        return self._inner.forward(inputs)


class RaisingBackend:
    """Raises the given exception on every forward (a model bug, or a device error)."""

    name = "fake"

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.calls = 0

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Always raise `exc`."""
        self.calls += 1
        raise self.exc


class FailingBackend:
    """Raises on every forward, like a model hitting a bug."""

    name = "fake"

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Always raise."""
        raise RuntimeError("boom: the model hit a bug")


class WrongDtypeBackend:
    """Returns FP64 where the config declares FP32."""

    name = "fake"

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the input as float64 under the name `y`."""
        return {"y": inputs["x"].to(torch.float64)}


def fake_model(config: dict[str, Any], backend: Any) -> LoadedModel:
    """A LoadedModel pairing `config` with a fake backend."""
    return LoadedModel(spec=spec_for(config), backend=backend)
