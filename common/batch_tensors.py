"""One buffer per tensor name per batch on the router ↔ worker hop (worker.proto `BatchTensor`): packing
items' rows into it and splitting it back into items.

Rules:
- items' rows are concatenated along the batch dim in item order; each item's rows count is carried beside
  the tensor (`Batch.item_rows`, `BatchResult.item_rows`), never inside it;
- `row_shape` holds the dims of one row when every item shares them, else (`ragged`) every item's row
  dims one item after another — variable dims within a shape bucket may differ between items;
- a tensor whose buffer, shapes or item count disagree is malformed as a whole (InvalidArgument naming
  the tensor, reason "bad_batch"): only routers and workers of the cluster write these, so it is a bug in
  the sender, never one item's fault;
- splitting costs one `frombuffer` per tensor; items get views of it, no per-item copy on the worker.
The router packs inputs from the canonical bytes each request was decoded into (`pack_buffers`) and
splits outputs into per-item bytes only when it answers (`split_buffers`); the worker splits inputs into
views (`split_arrays`) and packs each output of a batch's items with one copy (`pack_arrays`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice_inference.common.errors import InvalidArgument
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.tensors import DATATYPES, datatype_of, dtype_of, element_count

Array = npt.NDArray[Any]
Shape = tuple[int, ...]
_DATATYPE_OF: dict[np.dtype[Any], str] = {dtype: name for name, dtype in DATATYPES.items()}
"""`datatype_of` for the canonical dtypes, as one lookup: it runs for every output of every answer."""


def pack_buffers(
    name: str, datatype: str, row_shapes: Sequence[Shape], buffers: Sequence[bytes]
) -> worker_pb2.BatchTensor:
    """Items' canonical little-endian buffers (one per item, rows of `row_shapes[i]` each) as one tensor:
    one join, the only copy the router makes of a batch's inputs."""
    first = row_shapes[0] if row_shapes else ()
    ragged = any(shape != first for shape in row_shapes)
    row_shape = [dim for shape in row_shapes for dim in shape] if ragged else first
    data = buffers[0] if len(buffers) == 1 else b"".join(buffers)
    return worker_pb2.BatchTensor(name=name, datatype=datatype, row_shape=row_shape, ragged=ragged, data=data)


def pack_arrays(name: str, arrays: Sequence[Array]) -> worker_pb2.BatchTensor:
    """Items' arrays (batch dim first, one dtype) as one tensor: one concatenation when their rows agree
    in shape, else their bytes joined."""
    dtype = arrays[0].dtype
    datatype = _DATATYPE_OF.get(dtype) or datatype_of(dtype)
    little = DATATYPES[datatype]
    first: Shape = arrays[0].shape[1:]
    ragged = False
    for array in arrays:  # a loop, not a generator: this runs for every output of every answer
        if array.shape[1:] != first:
            ragged = True
            break
    if ragged:
        data = b"".join(np.ascontiguousarray(a, dtype=little).tobytes() for a in arrays)
        row_shape: Sequence[int] = [dim for array in arrays for dim in array.shape[1:]]
    else:
        whole = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        data = np.ascontiguousarray(whole, dtype=little).tobytes()
        row_shape = first
    return worker_pb2.BatchTensor(name=name, datatype=datatype, row_shape=row_shape, ragged=ragged, data=data)


def whole_array(tensor: worker_pb2.BatchTensor, rows: Sequence[int]) -> Array:
    """Every item's rows as one array (read-only, one `frombuffer`), for a tensor that is not ragged."""
    if tensor.ragged:
        raise ValueError(f"batch tensor {tensor.name[:64]!r} is ragged: its items have no one shape")
    data = tensor.data  # read once: each read of a bytes field makes a new object
    dims = tuple(tensor.row_shape)
    itemsize = dtype_of(tensor.datatype, tensor=tensor.name).itemsize
    shape = (sum(rows), *dims)
    total = element_count(shape, tensor=tensor.name) * itemsize  # the rule of `_layout`, for the whole
    if total != len(data):
        raise _malformed(tensor, f"its items' shapes need {total} bytes, the buffer holds {len(data)}")
    return np.frombuffer(data, dtype=DATATYPES[tensor.datatype]).reshape(shape)


def row_ranges(whole: Array, rows: Sequence[int]) -> list[Array]:
    """Each item's rows of `whole`, as views."""
    arrays, start = [], 0
    for count in rows:
        arrays.append(whole[start : start + count])
        start += count
    return arrays


def split_arrays(tensor: worker_pb2.BatchTensor, rows: Sequence[int]) -> list[Array]:
    """Each item's array: views of one `frombuffer` of the tensor's buffer (read-only)."""
    if not tensor.ragged:
        return row_ranges(whole_array(tensor, rows), rows)
    data = tensor.data
    layout = _layout(tensor, rows, len(data))
    flat = np.frombuffer(data, dtype=DATATYPES[tensor.datatype])
    arrays, start = [], 0
    for shape, elements in layout:
        arrays.append(flat[start : start + elements].reshape(shape))
        start += elements
    return arrays


def split_buffers(tensor: worker_pb2.BatchTensor, rows: Sequence[int]) -> list[tuple[Shape, bytes]]:
    """Each item's shape and bytes (one slice of the buffer each): what the router answers a request with."""
    data = tensor.data
    layout = _layout(tensor, rows, len(data))
    itemsize = DATATYPES[tensor.datatype].itemsize
    out, start = [], 0
    for shape, elements in layout:
        stop = start + elements * itemsize
        out.append((shape, data[start:stop]))
        start = stop
    return out


def _layout(tensor: worker_pb2.BatchTensor, rows: Sequence[int], size: int) -> list[tuple[Shape, int]]:
    """Each item's shape and element count; InvalidArgument unless they add up to the buffer's `size`
    bytes exactly."""
    count = len(rows)
    dims = tuple(tensor.row_shape)
    itemsize = dtype_of(tensor.datatype, tensor=tensor.name).itemsize
    if tensor.ragged:
        if count == 0 or len(dims) % count:
            raise _malformed(tensor, f"{len(dims)} row dims for {count} items")
        rank = len(dims) // count
        shapes = [(rows[i], *dims[i * rank : (i + 1) * rank]) for i in range(count)]
        layout = [(shape, element_count(shape, tensor=tensor.name)) for shape in shapes]
    else:
        per_row = element_count(dims, tensor=tensor.name)
        element_count((sum(rows), *dims), tensor=tensor.name)  # bounds the whole buffer's span
        layout = [((r, *dims), r * per_row) for r in rows]
    total = sum(elements for _, elements in layout) * itemsize
    if total != size:
        raise _malformed(tensor, f"its items' shapes need {total} bytes, the buffer holds {size}")
    return layout


def _malformed(tensor: worker_pb2.BatchTensor, why: str) -> InvalidArgument:
    return InvalidArgument(f"batch tensor {tensor.name[:64]!r} is malformed: {why}", reason="bad_batch")
