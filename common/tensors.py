"""Tensor codec between numpy and the forms tensors travel in: raw little-endian buffers and typed values
(the worker stream's packed batch tensors: common/batch_tensors.py).

Invariant: every decoded array is C-contiguous with the exact dtype its datatype names and the exact shape
the request declared; every malformed input raises `InvalidArgument` naming the tensor and what is wrong.
Raw buffers are little-endian (the protocol's rule), so on the wire bytes are canonical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice_inference.common.errors import InvalidArgument
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve

# Protocol datatype → little-endian numpy dtype. BYTES (variable-length strings) is not served yet.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

# Datatype → the InferTensorContents field that carries it in typed form (the protocol's table).
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def dtype_of(datatype: str, *, tensor: str = "") -> np.dtype[Any]:
    """The numpy dtype for a protocol datatype, or InvalidArgument."""
    try:
        return DATATYPES[datatype]
    except KeyError:
        where = f"tensor {tensor!r}: " if tensor else ""
        raise InvalidArgument(
            f"{where}unsupported datatype {datatype!r} (supported: {', '.join(DATATYPES)})",
            reason="bad_datatype",
        ) from None


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The protocol datatype naming a numpy dtype."""
    for name, candidate in DATATYPES.items():
        if candidate == dtype.newbyteorder("<") or candidate == dtype:
            return name
    raise InvalidArgument(f"numpy dtype {dtype} has no protocol datatype", reason="bad_datatype")


MAX_SHAPE_SPAN = 2**32
"""Bound on the product of a shape's dims, zeros counted as one. No tensor a message can carry comes near
it, and numpy refuses shapes past its own bound even when they hold no element: `[1, 3, 0, 2**61]` with an
empty buffer raised ValueError inside numpy, an INTERNAL with a logged traceback per request."""


def element_count(shape: Sequence[int], *, tensor: str) -> int:
    """Number of elements of a fully specified shape; negative dims, and dims whose product (zeros counted
    as one) exceeds `MAX_SHAPE_SPAN`, are an error."""
    count, span = 1, 1
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(
                f"tensor {tensor!r}: shape {shown_shape(shape)} has a negative dimension", reason="bad_shape"
            )
        count *= dim
        span *= max(dim, 1)
        if span > MAX_SHAPE_SPAN:
            raise InvalidArgument(
                f"tensor {tensor!r}: shape {shown_shape(shape)} spans more than {MAX_SHAPE_SPAN} elements",
                reason="bad_shape",
            )
    return count


def shown_shape(shape: Sequence[int]) -> str:
    """A shape for an error message, cut short: a hostile shape can have millions of dims."""
    if len(shape) <= 8:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:8]))}, ...] ({len(shape)} dims)"


def from_raw(name: str, datatype: str, shape: Sequence[int], data: bytes) -> npt.NDArray[Any]:
    """Decode a raw little-endian buffer, checking its length against shape and dtype."""
    dtype = dtype_of(datatype, tensor=name)
    count = element_count(shape, tensor=name)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidArgument(
            f"tensor {name!r}: {datatype}{shown_shape(shape)} needs {expected} bytes, got {len(data)}",
            reason="bad_size",
        )
    return np.frombuffer(data, dtype=dtype).reshape(tuple(shape))


def from_values(
    name: str, datatype: str, shape: Sequence[int], values: Sequence[bool | int | float] | None
) -> npt.NDArray[Any]:
    """Decode typed values (row-major), checking the datatype can be sent typed and the count matches the
    shape; `values` None means the client sent none this datatype can carry."""
    dtype = dtype_of(datatype, tensor=name)
    if datatype not in CONTENTS_FIELD:
        raise InvalidArgument(f"tensor {name!r}: {datatype} cannot be sent as typed contents; use raw")
    count = element_count(shape, tensor=name)
    given = 0 if values is None else len(values)
    if given != count:
        raise InvalidArgument(
            f"tensor {name!r}: {datatype}{shown_shape(shape)} needs {count} values, got {given}",
            reason="bad_size",
        )
    try:
        array = np.asarray(values if values is not None else (), dtype=dtype)
    except OverflowError:
        raise InvalidArgument(f"tensor {name!r}: a value does not fit {datatype}") from None
    return array.reshape(tuple(shape))


def from_contents(
    name: str, datatype: str, shape: Sequence[int], contents: kserve.InferTensorContents
) -> npt.NDArray[Any]:
    """Decode KServe typed `contents`: the field the datatype uses (`CONTENTS_FIELD`), as `from_values`."""
    field = CONTENTS_FIELD.get(datatype)
    return from_values(name, datatype, shape, None if field is None else getattr(contents, field))
