"""Decoding tensors from the wire: every malformed shape is a typed INVALID_ARGUMENT, never an error
from deep inside numpy."""

from __future__ import annotations

import pytest

from sluice_inference.common.errors import Code, InvalidArgument
from sluice_inference.common.tensors import MAX_SHAPE_SPAN, element_count, from_raw, from_values


@pytest.mark.parametrize("shape", [[1, 3, 0, 2**61], [1, 0, 2**33], [2**17, 2**16]])
def test_a_shape_past_the_span_bound_is_invalid_even_when_it_holds_no_element(shape: list[int]) -> None:
    with pytest.raises(InvalidArgument) as caught:
        from_raw("x", "FP32", shape, b"")
    assert caught.value.code == Code.INVALID_ARGUMENT and caught.value.reason == "bad_shape"
    with pytest.raises(InvalidArgument):
        from_values("x", "FP32", shape, [])


def test_empty_and_ordinary_shapes_still_decode() -> None:
    assert from_raw("x", "FP32", [1, 3, 0, 7], b"").shape == (1, 3, 0, 7)
    assert from_raw("x", "FP32", [2, 2], b"\0" * 16).shape == (2, 2)
    assert element_count([1, MAX_SHAPE_SPAN], tensor="x") == MAX_SHAPE_SPAN


def test_an_error_message_shows_at_most_eight_dims_of_a_hostile_shape() -> None:
    with pytest.raises(InvalidArgument) as caught:
        from_raw("x", "FP32", [1] * 1_000_000, b"")
    assert "(1000000 dims)" in caught.value.message and len(caught.value.message) < 200
