"""Building worker-stream batches and reading their results in tests, item by item, over the packed wire
form (common/batch_tensors.py): tests state items, the wire carries one buffer per tensor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from sluice_inference.common.batch_tensors import pack_arrays, split_arrays
from sluice_inference.common.pb.sluice.v1 import worker_pb2

Array = npt.NDArray[Any]


def packed_batch(
    batch_id: int,
    model: str,
    version: str,
    items: Sequence[tuple[int, Mapping[str, Array]]],
    *,
    budget_us: int = 0,
    outputs: Sequence[str] = (),
) -> worker_pb2.Batch:
    """A batch of `(item_id, {input name: array})` items, each with `budget_us`, packed as routers send it."""
    names = list(items[0][1]) if items else []
    return worker_pb2.Batch(
        batch_id=batch_id,
        model=model,
        version=version,
        outputs=list(outputs),
        item_ids=[item_id for item_id, _ in items],
        item_rows=[len(next(iter(inputs.values()))) for _, inputs in items],
        budgets_us=[budget_us] * len(items),
        inputs=[pack_arrays(name, [inputs[name] for _, inputs in items]) for name in names],
    )


@dataclass(frozen=True)
class ItemView:
    """One item's outcome read back from a BatchResult: its error, or its outputs in the result's order."""

    item_id: int
    error: worker_pb2.ItemError = field(default_factory=worker_pb2.ItemError)
    outputs: list[Array] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Whether the result listed this item among its errors."""
        return self.error.ByteSize() > 0


def items(result: worker_pb2.BatchResult) -> list[ItemView]:
    """Every item of a result (successes and errors), by item id."""
    columns = [split_arrays(tensor, result.item_rows) for tensor in result.outputs]
    views = [ItemView(error.item_id, error=error) for error in result.errors]
    views += [ItemView(item_id, outputs=[c[i] for c in columns]) for i, item_id in enumerate(result.item_ids)]
    assert len({v.item_id for v in views}) == len(views), "an item has two outcomes"
    return sorted(views, key=lambda v: v.item_id)


def first_values(result: worker_pb2.BatchResult) -> dict[int, float]:
    """Item id → its first output's first value, for items that succeeded."""
    return {v.item_id: float(np.asarray(v.outputs[0]).flat[0]) for v in items(result) if not v.failed}
