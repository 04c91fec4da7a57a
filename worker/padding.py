"""Shape buckets: pad variable-length inputs up to a declared size so requests of nearby lengths share a
batch, and build the mask that tells a masked model which positions are real.

Rule: an input's variable dim (-1 in its config) is padded with the model's `pad_value` up to the smallest
declared bucket that fits (`batching.buckets[input]`); without buckets it keeps its exact length, so only
identical shapes batch together. The mask (config `batching.mask_input`) is 1.0 on real positions and 0.0
on padding, one row per batch row, for the masked input's variable dim. A model that pools with the mask
gives a row the same output batched and padded as alone (tested within 1e-5 for the `encoder` demo).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice_inference.common.buckets import bucketed
from sluice_inference.worker.model_config import ModelConfig, TensorConfig

Array = npt.NDArray[Any]
ShapeKey = tuple[tuple[int, ...], ...]
"""Each input's non-batch dims after padding, in config order: items with equal keys stack together."""


def padded_dims(config: ModelConfig, spec: TensorConfig, shape: Sequence[int]) -> tuple[int, ...]:
    """The non-batch dims of an input after padding its variable dims to their bucket."""
    if not spec.is_variable and len(shape) == len(spec.dims) + 1:
        return tuple(shape[1:])  # nothing to pad: what `bucketed` gives, without a bucket lookup per dim
    return bucketed(spec.dims, shape[1:], config.batching.buckets.get(spec.name, ()))


def group_key(config: ModelConfig, inputs: Mapping[str, Array]) -> ShapeKey:
    """Items with equal keys can be padded to one shape and stacked."""
    return tuple(padded_dims(config, spec, inputs[spec.name].shape) for spec in config.inputs)


def pad(array: Array, target: Sequence[int], value: float) -> Array:
    """`array` padded at the end of each non-batch dim up to `target` (no copy when nothing to pad)."""
    if array.shape[1:] == tuple(target):
        return array
    widths = [(0, 0)] + [(0, want - have) for have, want in zip(array.shape[1:], target, strict=True)]
    if all(after == 0 for _, after in widths):
        return array
    return np.pad(array, widths, mode="constant", constant_values=value)


def stack(config: ModelConfig, items: Sequence[dict[str, Array]]) -> tuple[dict[str, Array], Array | None]:
    """The batch's inputs, each item padded to the group's bucket and concatenated; and the mask, if the
    model takes one."""
    batch: dict[str, Array] = {}
    for spec in config.inputs:
        if spec.is_variable:
            target = padded_dims(config, spec, items[0][spec.name].shape)
            padded = [pad(item[spec.name], target, config.batching.pad_value) for item in items]
        else:  # nothing to pad: the group's items share its exact shape (their shape key)
            padded = [item[spec.name] for item in items]
        # One item is copied all the same: the batch must not share memory with the (read-only) wire buffer.
        batch[spec.name] = padded[0].copy() if len(padded) == 1 else np.concatenate(padded)
    masked = config.masked_input
    if masked is None:
        return batch, None
    axis = 1 + masked.dims.index(-1)
    padded_length = batch[masked.name].shape[axis]
    rows = []
    for item in items:
        array = item[masked.name]
        row = np.zeros((array.shape[0], padded_length), dtype=np.float32)
        row[:, : array.shape[axis]] = 1.0
        rows.append(row)
    return batch, np.concatenate(rows)
