"""Shape buckets, shared by the router (lane keys, batch cost) and the worker (padding).

A variable dim is rounded up to the smallest declared bucket that fits; with no buckets it keeps its exact
size, so only identical shapes share a batch. Both sides must agree, or the router would put requests in
one lane that the worker pads to different shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from sluice_inference.common.errors import InvalidArgument


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` (the length itself when no buckets are declared)."""
    if not buckets:
        return length
    for size in buckets:
        if size >= length:
            return size
    raise InvalidArgument(f"length {length} exceeds the largest bucket {buckets[-1]}", reason="bad_shape")


def bucketed(dims: Sequence[int], shape: Sequence[int], buckets: Sequence[int]) -> tuple[int, ...]:
    """Non-batch `shape` with each variable dim (-1 in `dims`) rounded up to its bucket."""
    return tuple(
        bucket_for(size, buckets) if declared == -1 else size
        for declared, size in zip(dims, shape, strict=True)
    )


def padded_cost(dims: Sequence[int], padded: Sequence[int]) -> int:
    """Elements along the variable dims of one row after padding (1 for fixed-shape inputs)."""
    return math.prod(size for declared, size in zip(dims, padded, strict=True) if declared == -1)


def row_cost(inputs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
    """What one row costs against a model's `max_batch_cost`: the sum over its inputs (declared dims,
    padded non-batch shape) of `padded_cost`, at least 1. A batch costs its rows times this."""
    return max(1, sum(padded_cost(dims, padded) for dims, padded in inputs))
