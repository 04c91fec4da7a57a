"""Between the executor's batch and the model: Triton-style reshapes and a model placed on its own device.

The executor stacks tensors in the shapes clients send (`[rows, *dims]`) on the worker's device. A model
that declares `reshape` on a tensor takes or returns `[rows, *reshape]` instead, and a model placed on
the CPU of a GPU worker (`device: cpu`, Triton's KIND_CPU) takes its inputs on the CPU. `Boundary` wraps
a backend only when one of the two applies, so every other model is called directly. Outputs may come
back on any device: the executor copies them to host memory either way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sluice_inference.worker.backends.base import Backend
from sluice_inference.worker.model_config import ModelConfig


def at_boundary(backend: Backend, config: ModelConfig, device: str, worker_device: str) -> Backend:
    """`backend` itself, or wrapped in a Boundary when the model reshapes or sits on another device."""
    reshapes = any(t.reshape is not None for t in (*config.inputs, *config.outputs))
    if not reshapes and torch.device(device) == torch.device(worker_device):
        return backend
    return Boundary(backend, config, device)


class Boundary:
    """Reshapes inputs to what the model takes and outputs to what clients get; moves inputs over."""

    def __init__(self, inner: Backend, config: ModelConfig, device: str) -> None:
        self._inner = inner
        self._device = torch.device(device)
        self._inputs = {t.name: t.reshape for t in config.inputs if t.reshape is not None}
        self._outputs = {t.name: t.dims for t in config.outputs if t.reshape is not None}

    @property
    def name(self) -> str:
        """The wrapped backend's kind."""
        return self._inner.name

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reshape and move the inputs, run the model, reshape its outputs back to the config's dims."""
        moved = {}
        for name, tensor in inputs.items():
            shape = self._inputs.get(name)
            on_device = tensor.to(self._device)
            moved[name] = on_device if shape is None else on_device.reshape(tensor.shape[0], *shape)
        produced = self._inner.forward(moved)
        for name, dims in self._outputs.items():
            if name in produced:
                produced[name] = produced[name].reshape(produced[name].shape[0], *dims)
        return produced
