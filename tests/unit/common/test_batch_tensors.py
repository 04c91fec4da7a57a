"""The hop's batch tensors: items packed into one buffer come back as the same items, ragged or not, on
either side; a buffer that disagrees with its items' shapes is malformed as a whole, never read past."""

from __future__ import annotations

import numpy as np
import pytest

from sluice_inference.common.batch_tensors import pack_arrays, pack_buffers, split_arrays, split_buffers
from sluice_inference.common.errors import InvalidArgument
from sluice_inference.common.pb.sluice.v1 import worker_pb2

RNG = np.random.default_rng(3)


def test_uniform_items_round_trip_as_views_of_one_buffer() -> None:
    items = [RNG.standard_normal((rows, 4)).astype("<f4") for rows in (1, 3, 2)]
    tensor = pack_arrays("x", items)
    assert (list(tensor.row_shape), tensor.ragged, tensor.datatype) == ([4], False, "FP32")
    arrays = split_arrays(tensor, [1, 3, 2])
    for given, got in zip(items, arrays, strict=True):
        np.testing.assert_array_equal(got, given)
    assert all(a.base is arrays[0].base for a in arrays)  # one frombuffer, no copy per item


def test_ragged_items_carry_each_items_row_dims() -> None:
    items = [np.arange(n, dtype="<i8").reshape(1, n) for n in (5, 2, 7)]
    tensor = pack_arrays("tokens", items)
    assert tensor.ragged and list(tensor.row_shape) == [5, 2, 7]
    for given, got in zip(items, split_arrays(tensor, [1, 1, 1]), strict=True):
        np.testing.assert_array_equal(got, given)


def test_router_side_buffers_round_trip_to_each_items_bytes() -> None:
    rows = [np.full((1, 3), i, "<f4") for i in range(3)]
    tensor = pack_buffers("y", "FP32", [(3,)] * 3, [r.tobytes() for r in rows])
    assert split_buffers(tensor, [1, 1, 1]) == [((1, 3), r.tobytes()) for r in rows]
    ragged = pack_buffers("y", "FP32", [(1,), (2,)], [b"\0" * 4, b"\1" * 8])
    assert split_buffers(ragged, [1, 1]) == [((1, 1), b"\0" * 4), ((1, 2), b"\1" * 8)]


def test_an_empty_batch_packs_nothing() -> None:
    tensor = pack_buffers("x", "FP32", [], [])
    assert split_buffers(tensor, []) == [] and tensor.data == b""


@pytest.mark.parametrize(
    ("tensor", "rows"),
    [
        (worker_pb2.BatchTensor(name="x", datatype="FP32", row_shape=[4], data=b"\0" * 12), [1]),  # short
        (worker_pb2.BatchTensor(name="x", datatype="FP32", row_shape=[4], data=b"\0" * 20), [1]),  # long
        (worker_pb2.BatchTensor(name="x", datatype="FP32", row_shape=[1, 2, 3], ragged=True), [1, 1]),
        (worker_pb2.BatchTensor(name="x", datatype="FP32", row_shape=[-4], data=b""), [1]),
        (worker_pb2.BatchTensor(name="x", datatype="FP32", row_shape=[2**40, 2**40], data=b""), [0]),
        (worker_pb2.BatchTensor(name="x", datatype="BYTES", row_shape=[1], data=b"a"), [1]),
    ],
)
def test_a_tensor_that_disagrees_with_its_items_is_invalid_as_a_whole(
    tensor: worker_pb2.BatchTensor, rows: list[int]
) -> None:
    with pytest.raises(InvalidArgument):
        split_arrays(tensor, rows)
    with pytest.raises(InvalidArgument):
        split_buffers(tensor, rows)
