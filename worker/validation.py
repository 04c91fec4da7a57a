"""What a valid item is, and valid outputs: the checks the executor runs before and after a forward.

Every input is checked against the model's config before it reaches the device (an item that fails is
refused alone, InvalidArgument naming the tensor): names, datatype, shape (batch first, -1 variable),
bucket bounds, declared value ranges, and a row count all inputs agree on within 1..max_batch_size. A
model's outputs that disagree with its config raise ValueError (the executor makes it Internal).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice_inference.common.errors import InvalidArgument
from sluice_inference.common.tensors import DATATYPES
from sluice_inference.worker.model_config import ModelConfig, TensorConfig

Array = npt.NDArray[Any]


def item_rows(config: ModelConfig, inputs: Mapping[str, Any]) -> int:
    """The item's row count, or InvalidArgument naming the tensor and what is wrong."""
    expected = {t.name for t in config.inputs}
    missing = sorted(expected - set(inputs))
    extra = sorted(set(inputs) - expected)
    if missing or extra:
        raise InvalidArgument(
            f"model {config.name!r} takes inputs {sorted(expected)}; missing {missing}, unexpected {extra}",
            reason="bad_input",
        )
    row_counts = set()
    for spec in config.inputs:
        array = inputs[spec.name]
        want = DATATYPES[spec.datatype]
        if not isinstance(array, np.ndarray) or array.dtype != want:
            got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
            raise InvalidArgument(
                f"input {spec.name!r}: expected {spec.datatype}, got {got}", reason="bad_datatype"
            )
        _check_shape(config, spec.name, spec.dims, array.shape)
        _check_range(spec, array)
        row_counts.add(array.shape[0])
    if len(row_counts) != 1:
        raise InvalidArgument(f"inputs disagree on the batch dim: {sorted(row_counts)}", reason="bad_shape")
    rows = row_counts.pop()
    if not 1 <= rows <= config.max_batch_size:
        raise InvalidArgument(
            f"a request carries {rows} rows; model {config.name!r} takes 1..{config.max_batch_size}",
            reason="bad_shape",
        )
    return int(rows)


def _check_shape(config: ModelConfig, name: str, dims: tuple[int, ...], shape: tuple[int, ...]) -> None:
    wanted = [-1, *dims]
    fits = len(shape) == len(wanted) and all(w in (-1, s) for w, s in zip(wanted, shape, strict=True))
    if not fits:
        raise InvalidArgument(
            f"input {name!r}: expected shape {wanted} (batch first, -1 variable), got {list(shape)}",
            reason="bad_shape",
        )
    buckets = config.batching.buckets.get(name)
    if buckets:
        too_long = [s for w, s in zip(dims, shape[1:], strict=True) if w == -1 and s > buckets[-1]]
        if too_long:
            raise InvalidArgument(
                f"input {name!r}: length {too_long[0]} exceeds the largest bucket {buckets[-1]}",
                reason="bad_shape",
            )


def _check_range(spec: TensorConfig, array: Array) -> None:
    """InvalidArgument when an element lies outside the input's declared range (the router checks first;
    this is defence in depth, since an out-of-range index can break a CUDA device for good)."""
    if spec.range is None or array.size == 0:
        return
    lo, hi = spec.range
    smallest, largest = array.min(), array.max()
    if smallest < lo or largest > hi:
        bad = smallest if smallest < lo else largest
        raise InvalidArgument(
            f"input {spec.name!r}: value {bad} is outside its range [{lo}, {hi}]", reason="out_of_range"
        )


def check_outputs(config: ModelConfig, arrays: dict[str, Array], rows: int) -> None:
    """Raise ValueError when the model's outputs disagree with the config (caught as Internal)."""
    by_name = {t.name: t for t in config.outputs}
    for name, array in arrays.items():
        spec = by_name[name]
        if array.dtype != DATATYPES[spec.datatype]:
            raise ValueError(f"output {name!r} is {array.dtype}, config declares {spec.datatype}")
        wanted = [rows, *spec.dims]
        shape = list(array.shape)
        if len(shape) != len(wanted) or any(w not in (-1, s) for w, s in zip(wanted, shape, strict=True)):
            raise ValueError(f"output {name!r} has shape {shape}, expected {wanted}")
