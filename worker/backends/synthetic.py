"""SIMULATED backend: a GPU-like latency profile with no real model behind it (for scheduling benchmarks).

A forward over b rows of padded length L sleeps `(base_ms + per_item_ms * b + per_token_ms * b * L) *
slowdown` (L counts only for a variable-length first input; time.sleep: it runs on the
executor's thread, like a real forward would block it) and returns a deterministic function of the first
input: each output row is `x * 2 + 1` over that input's row (as FP32), tiled or cut to the output's
per-row size, then cast to the output's datatype. Nothing here measures or models a real device; every
number is configured. `slowdown` (worker setting `synthetic_slowdown`) makes one worker a slower device.

Poison marker: a row whose first input value is `POISON` makes the whole forward raise, like a model bug
triggered by one input; the executor's bisection must then fail only that row's request.

Simulated device fault (test/demo only, config `synthetic.fault_trigger`): a row whose first input value
equals the trigger makes this forward and every later one raise the RuntimeError of a CUDA device-side
assert, as a real broken CUDA context would; the worker must then leave and exit (worker/faults.py).
Simulated hang (test/demo only, `synthetic.hang_trigger`): such a row makes the forward sleep `hang_s`,
a device that never returns while the worker's event loop and heartbeats carry on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import torch

from sluice_inference.worker.backends.base import TORCH_DTYPES
from sluice_inference.worker.model_config import ModelConfig

POISON = -12345.0
SIMULATED_FAULT = "CUDA error: device-side assert triggered (SIMULATED by synthetic.fault_trigger)"


class SyntheticBackend:
    """Simulated latency, deterministic outputs."""

    name = "synthetic"

    def __init__(self, config: ModelConfig, device: str, slowdown: float = 1.0) -> None:
        if config.synthetic is None:
            raise ValueError(f"model {config.name!r}: the synthetic backend needs a `synthetic` section")
        self._base_s = config.synthetic.base_ms / 1000.0 * slowdown
        self._per_item_s = config.synthetic.per_item_ms / 1000.0 * slowdown
        self._per_token_s = config.synthetic.per_token_ms / 1000.0 * slowdown
        self._variable = any(-1 in t.dims for t in config.inputs[:1])
        self._first_input = config.inputs[0].name
        self._outputs = config.outputs
        self._device = torch.device(device)
        self._fault_trigger = config.synthetic.fault_trigger
        self._hang_trigger = config.synthetic.hang_trigger
        self._hang_s = config.synthetic.hang_s
        self._faulted = False

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sleep the simulated latency for this batch size, then compute the deterministic outputs."""
        x = inputs[self._first_input]
        rows = x.shape[0]
        tokens = math.prod(x.shape[1:]) if self._variable else 0
        time.sleep(self._base_s + self._per_item_s * rows + self._per_token_s * rows * tokens)
        flat = x.reshape(rows, -1).to(torch.float32)
        if flat.shape[1] and bool((flat[:, 0] == POISON).any()):
            raise RuntimeError("synthetic model: poison input (first value = POISON) in this batch")
        if (
            self._hang_trigger is not None
            and flat.shape[1]
            and bool((flat[:, 0] == self._hang_trigger).any())
        ):
            time.sleep(self._hang_s)
        if self._fault_trigger is not None and flat.shape[1]:
            self._faulted = self._faulted or bool((flat[:, 0] == self._fault_trigger).any())
        if self._faulted:
            raise RuntimeError(SIMULATED_FAULT)
        results: dict[str, torch.Tensor] = {}
        for output in self._outputs:
            width = math.prod(output.dims)
            if flat.shape[1] == 0:
                values = torch.zeros((rows, width), device=self._device)
            else:
                index = torch.arange(width, device=flat.device) % flat.shape[1]
                values = flat[:, index] * 2 + 1
            results[output.name] = values.reshape(rows, *output.dims).to(TORCH_DTYPES[output.datatype])
        return results
