"""The synthetic backend's outputs and markers, held to the formula its docstring states: each output row
is `x * 2 + 1` over the first input's row (as FP32), tiled or cut to the output's per-row size, then cast;
the fast paths (no gather when the widths agree, gathers built once, markers read as floats) must give
exactly what that formula gives."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch

from sluice_inference.worker.backends.base import TORCH_DTYPES
from sluice_inference.worker.backends.synthetic import POISON, SIMULATED_FAULT, SyntheticBackend
from sluice_inference.worker.model_config import ModelConfig


def backend(
    input_dims: list[int], outputs: list[tuple[list[int], str]], **synthetic: Any
) -> SyntheticBackend:
    """A zero-latency synthetic model with input `x` (FP32) and outputs `y0`, `y1`, ... of these dims."""
    config = ModelConfig.model_validate(
        {
            "name": "s",
            "backend": "synthetic",
            "inputs": [{"name": "x", "datatype": "FP32", "dims": input_dims}],
            "outputs": [
                {"name": f"y{i}", "datatype": datatype, "dims": dims}
                for i, (dims, datatype) in enumerate(outputs)
            ],
            "max_batch_size": 8,
            "synthetic": {"base_ms": 0, "per_item_ms": 0, **synthetic},
        }
    )
    return SyntheticBackend(config, "cpu")


def expected(x: np.ndarray, dims: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The docstring's formula, computed independently in numpy."""
    rows = x.shape[0]
    flat = x.reshape(rows, -1).astype(np.float32)
    width = math.prod(dims)
    columns = np.arange(width) % flat.shape[1]
    return torch.from_numpy((flat[:, columns] * 2 + 1).reshape(rows, *dims)).to(dtype)


@pytest.mark.parametrize(
    ("input_dims", "output_dims", "datatype"),
    [
        ([4], [4], "FP32"),  # equal widths: no gather
        ([3], [7], "FP32"),  # tiled
        ([6], [2], "FP32"),  # cut
        ([2, 3], [2, 3], "FP32"),  # equal widths, two dims
        ([4], [2, 5], "FP32"),  # tiled into two dims
        ([4], [], "FP32"),  # one value per row
        ([4], [4], "INT64"),  # cast
        ([5], [3], "FP16"),
    ],
)
def test_outputs_follow_the_formula(input_dims: list[int], output_dims: list[int], datatype: str) -> None:
    model = backend(input_dims, [(output_dims, datatype), ([9], "FP32")])
    x = np.random.default_rng(7).standard_normal((3, *input_dims)).astype(np.float32) * 10
    for _ in range(2):  # the second forward uses the gathers the first one built
        produced = model.forward({"x": torch.from_numpy(x)})
        want = expected(x, output_dims, TORCH_DTYPES[datatype])
        assert produced["y0"].dtype == want.dtype
        assert produced["y0"].shape == want.shape
        assert torch.equal(produced["y0"], want)
        assert torch.equal(produced["y1"], expected(x, [9], torch.float32))


def test_an_empty_input_row_gives_zeros() -> None:
    produced = backend([-1], [([3], "FP32")]).forward({"x": torch.zeros((2, 0))})
    assert torch.equal(produced["y0"], torch.zeros((2, 3)))


def test_an_integer_input_is_read_as_fp32() -> None:
    model = backend([4], [([4], "FP32")])
    x = np.arange(8, dtype=np.int64).reshape(2, 4)
    assert torch.equal(model.forward({"x": torch.from_numpy(x)})["y0"], expected(x, [4], torch.float32))


def test_poison_in_any_row_fails_the_forward() -> None:
    x = torch.tensor([[1.0, 2.0], [POISON, 0.0]])
    with pytest.raises(RuntimeError, match="poison"):
        backend([2], [([2], "FP32")]).forward({"x": x})
    # Only a row's first value is the marker.
    backend([2], [([2], "FP32")]).forward({"x": torch.tensor([[1.0, POISON]])})


def test_a_fault_trigger_matches_as_fp32_and_stays() -> None:
    """0.1 is not an FP32 value: a row starting with FP32(0.1) matches it, as an FP32 comparison does."""
    model = backend([2], [([2], "FP32")], fault_trigger=0.1)
    model.forward({"x": torch.tensor([[0.2, 0.1]])})  # not a row's first value
    with pytest.raises(RuntimeError, match="device-side assert"):
        model.forward({"x": torch.tensor([[0.0, 0.0], [0.1, 0.0]], dtype=torch.float32)})
    with pytest.raises(RuntimeError) as later:  # a broken device stays broken
        model.forward({"x": torch.tensor([[0.0, 0.0]])})
    assert str(later.value) == SIMULATED_FAULT


def test_a_hang_trigger_sleeps_its_hang() -> None:
    model = backend([2], [([2], "FP32")], hang_trigger=0.3, hang_s=0.2)
    before = time.monotonic()
    model.forward({"x": torch.tensor([[1.0, 0.3]])})  # not a row's first value
    assert time.monotonic() - before < 0.2
    model.forward({"x": torch.tensor([[0.3, 1.0]])})
    assert time.monotonic() - before >= 0.2
