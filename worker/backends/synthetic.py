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

import numpy as np
import torch

from sluice_inference.worker.backends.base import TORCH_DTYPES
from sluice_inference.worker.model_config import ModelConfig

POISON = -12345.0
_MAX_GATHERS = 64
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
        self._device = torch.device(device)
        # The triggers as an FP32 tensor compares them with its values: rounded to FP32.
        self._fault_trigger = _fp32(config.synthetic.fault_trigger)
        self._hang_trigger = _fp32(config.synthetic.hang_trigger)
        self._hang_s = config.synthetic.hang_s
        self._faulted = False
        # Resolved once, not per forward: each output's name, row width, dims and dtype.
        self._out = tuple(
            (t.name, math.prod(t.dims), tuple(t.dims), TORCH_DTYPES[t.datatype]) for t in config.outputs
        )
        self._gathers: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sleep the simulated latency for this batch size, then compute the deterministic outputs."""
        x = inputs[self._first_input]
        rows = x.shape[0]
        tokens = math.prod(x.shape[1:]) if self._variable else 0
        delay = self._base_s + self._per_item_s * rows + self._per_token_s * rows * tokens
        if delay > 0:
            time.sleep(delay)
        flat = x.reshape(rows, -1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        width_in = flat.shape[1]
        if width_in:
            self._check_triggers(flat[:, 0].tolist())
        if self._faulted:
            raise RuntimeError(SIMULATED_FAULT)
        results: dict[str, torch.Tensor] = {}
        for name, width, dims, dtype in self._out:
            if width_in == 0:
                values = torch.zeros((rows, width), device=self._device)
            elif width == width_in:  # the gather would pick every column in order
                values = flat * 2 + 1
            else:
                values = flat[:, self._gather(width, width_in, flat.device)] * 2 + 1
            if len(dims) != 1:
                values = values.reshape(rows, *dims)
            results[name] = values if dtype == torch.float32 else values.to(dtype)
        return results

    def _check_triggers(self, firsts: list[float]) -> None:
        """React to the markers among the rows' first values (FP32 values as floats, so `in` matches what
        an FP32 tensor comparison matches)."""
        if POISON in firsts:
            raise RuntimeError("synthetic model: poison input (first value = POISON) in this batch")
        if self._hang_trigger is not None and self._hang_trigger in firsts:
            time.sleep(self._hang_s)
        if self._fault_trigger is not None and self._fault_trigger in firsts:
            self._faulted = True

    def _gather(self, width: int, width_in: int, device: torch.device) -> torch.Tensor:
        """The columns an output row takes from the input row (tiled or cut), built once per pair of widths
        (a few: one per output and bucketed input length; the cache is cleared past `_MAX_GATHERS`)."""
        key = (width, width_in, device)
        index = self._gathers.get(key)
        if index is None:
            if len(self._gathers) >= _MAX_GATHERS:
                self._gathers.clear()
            index = self._gathers[key] = torch.arange(width, device=device) % width_in
        return index


def _fp32(value: float | None) -> float | None:
    """`value` rounded to FP32, as a comparison with an FP32 tensor rounds it."""
    return None if value is None else float(np.float32(value))
