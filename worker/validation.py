"""What a valid item is, and valid outputs: the checks the executor runs before and after a forward.

Every input is checked against the model's config before it reaches the device (an item that fails is
refused alone, InvalidArgument naming the tensor): names, datatype, shape (batch first, -1 variable),
bucket bounds, declared value ranges, and a row count all inputs agree on within 1..max_batch_size. A
model's outputs that disagree with its config raise ValueError (the executor makes it Internal).

The rules are resolved once per model version (`ModelChecks`, held by the loaded model): each batch then
pays only for comparing its arrays, not for reading the config again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice_inference.common.errors import InvalidArgument
from sluice_inference.common.tensors import DATATYPES
from sluice_inference.worker.model_config import ModelConfig, TensorConfig

Array = npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class _TensorRule:
    """One tensor's config as the checks read it: its dtype, its dims and the bucket bound of its
    variable dims."""

    spec: TensorConfig
    dtype: np.dtype[Any]
    wanted: tuple[int, ...]
    """(-1, *dims): the full shape, batch first."""
    fixed: bool
    """No variable dim: the shape matches exactly when its non-batch part equals `dims`."""
    longest: int | None
    """The largest bucket of the input's variable dims, when it declares buckets."""


def _rule(config: ModelConfig, spec: TensorConfig) -> _TensorRule:
    buckets = config.batching.buckets.get(spec.name)
    longest = buckets[-1] if buckets else None
    return _TensorRule(spec, DATATYPES[spec.datatype], (-1, *spec.dims), not spec.is_variable, longest)


class ModelChecks:
    """One model version's input and output checks, resolved from its config once."""

    def __init__(self, config: ModelConfig) -> None:
        self._config = config
        self._names = frozenset(t.name for t in config.inputs)
        self._inputs = tuple(_rule(config, spec) for spec in config.inputs)
        self._outputs = {spec.name: _rule(config, spec) for spec in config.outputs}
        self.output_names = tuple(spec.name for spec in config.outputs)
        """The declared outputs, in config order: what a batch that names none gets."""

    def item_rows(self, inputs: Mapping[str, Any]) -> int:
        """The item's row count, or InvalidArgument naming the tensor and what is wrong."""
        config = self._config
        if inputs.keys() != self._names:
            missing = sorted(self._names - set(inputs))
            extra = sorted(set(inputs) - self._names)
            raise InvalidArgument(
                f"model {config.name!r} takes inputs {sorted(self._names)}; missing {missing}, "
                f"unexpected {extra}",
                reason="bad_input",
            )
        rows: int | None = None
        agree = True
        for rule in self._inputs:
            spec = rule.spec
            array = inputs[spec.name]
            if not isinstance(array, np.ndarray) or array.dtype != rule.dtype:
                got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
                raise InvalidArgument(
                    f"input {spec.name!r}: expected {spec.datatype}, got {got}", reason="bad_datatype"
                )
            shape = array.shape
            if not (rule.fixed and len(shape) == len(rule.wanted) and shape[1:] == spec.dims):
                _check_shape(rule, shape)
            if spec.range is not None:
                _check_range(spec, array)
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                agree = False
        if not agree:
            counts = sorted({inputs[rule.spec.name].shape[0] for rule in self._inputs})
            raise InvalidArgument(f"inputs disagree on the batch dim: {counts}", reason="bad_shape")
        assert rows is not None  # a config declares at least one input
        if not 1 <= rows <= config.max_batch_size:
            raise InvalidArgument(
                f"a request carries {rows} rows; model {config.name!r} takes 1..{config.max_batch_size}",
                reason="bad_shape",
            )
        return int(rows)

    def outputs(self, arrays: dict[str, Array], rows: int) -> None:
        """Raise ValueError when the model's outputs disagree with the config (caught as Internal)."""
        for name, array in arrays.items():
            rule = self._outputs[name]
            spec = rule.spec
            if array.dtype != rule.dtype:
                raise ValueError(f"output {name!r} is {array.dtype}, config declares {spec.datatype}")
            shape = array.shape
            if rule.fixed and len(shape) == len(rule.wanted) and shape[0] == rows and shape[1:] == spec.dims:
                continue
            wanted = [rows, *spec.dims]
            if len(shape) != len(wanted) or any(w not in (-1, s) for w, s in zip(wanted, shape, strict=True)):
                raise ValueError(f"output {name!r} has shape {list(shape)}, expected {wanted}")


def _check_shape(rule: _TensorRule, shape: tuple[int, ...]) -> None:
    name, wanted = rule.spec.name, rule.wanted
    fits = len(shape) == len(wanted) and all(w in (-1, s) for w, s in zip(wanted, shape, strict=True))
    if not fits:
        raise InvalidArgument(
            f"input {name!r}: expected shape {list(wanted)} (batch first, -1 variable), got {list(shape)}",
            reason="bad_shape",
        )
    if rule.longest is not None:
        too_long = [s for w, s in zip(rule.spec.dims, shape[1:], strict=True) if w == -1 and s > rule.longest]
        if too_long:
            raise InvalidArgument(
                f"input {name!r}: length {too_long[0]} exceeds the largest bucket {rule.longest}",
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
