"""The seam between the executor and whatever computes a model: one `forward` over a whole batch.

Contract: every tensor in and out has the batch dimension first; `forward` is called from one thread at a
time (the executor's), under `torch.inference_mode()`; inputs are keyed by config input name, in config
order, with the backend-only mask input last when the model declares one; outputs are keyed by config
output name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

# Protocol datatype → torch dtype (the same element types as sluice_inference.common.tensors.DATATYPES).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}


class Backend(Protocol):
    """A loaded model version on one device."""

    @property
    def name(self) -> str:
        """The backend kind (`torch_export`, `torchscript`, `synthetic`); published as the platform."""
        ...

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run one batch; raises whatever the model raises (the executor turns it into item errors)."""
        ...


def name_outputs(result: object, output_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Key a module's return value by config output names.

    A dict is taken as is; a lone tensor is the single output; a tuple or list gives the outputs in config
    order. Anything else is a model/config mismatch and raises TypeError.
    """
    if isinstance(result, torch.Tensor):
        if len(output_names) != 1:
            raise TypeError(f"model returned one tensor but the config declares outputs {list(output_names)}")
        return {output_names[0]: result}
    if isinstance(result, Mapping):
        return {str(k): v for k, v in result.items() if isinstance(v, torch.Tensor)}
    if isinstance(result, tuple | list):
        if len(result) != len(output_names):
            raise TypeError(f"model returned {len(result)} tensors, config declares {list(output_names)}")
        return {name: value for name, value in zip(output_names, result, strict=True)}
    raise TypeError(f"model returned {type(result).__name__}, expected a tensor, tuple or dict of tensors")
