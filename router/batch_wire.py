"""A batch on the worker stream and back: the core's `Dispatch` as the wire `Batch` the worker runs, and the
wire `BatchResult` as the `BatchAnswer` the core reads (worker.proto; docs/design.md §4).

Both directions are packed: ids, rows and budgets as lists, one buffer per input (and per output) holding
every item's rows, so a batch costs a message, not a message per item. The one copy of an item's rows on
the router is made here: into the input buffer on the way out, out of the output buffer on the way back.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice_inference.common.batch_tensors import pack_buffers, split_buffers
from sluice_inference.common.errors import Code
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.router.calls import Tensor
from sluice_inference.router.codec import DecodedRequest
from sluice_inference.router.policy.deadline_budget import DeadlineBudget
from sluice_inference.router.policy.outcomes import BatchAnswer, Dispatch, ItemAnswer


def wire_batch(dispatch: Dispatch, decoded: Sequence[DecodedRequest], now: float) -> worker_pb2.Batch:
    """The wire batch of `dispatch` (`decoded`: its requests' inputs, in its order): ids, rows and budgets
    packed, one buffer per input holding every item's rows."""
    requests = dispatch.requests
    batch = worker_pb2.Batch(
        batch_id=dispatch.batch_id,
        model=dispatch.lane.model,
        version=dispatch.lane.version,
        item_ids=[r.request_id for r in requests],
        item_rows=[d.rows for d in decoded],
        budgets_us=[DeadlineBudget.wire_budget_us(r.deadline, now) for r in requests],
    )
    for index, first in enumerate(decoded[0].inputs):
        tensors = [d.inputs[index] for d in decoded]
        shapes = [t.shape[1:] for t in tensors]
        batch.inputs.append(pack_buffers(first.name, first.datatype, shapes, [t.data for t in tensors]))
    return batch


def core_answer(result: worker_pb2.BatchResult) -> BatchAnswer:
    """A worker's BatchResult as the core reads it (outputs stay the shell's): each output's buffer split
    into the items' own tensors here, the one place the router copies an item's rows."""
    items = {}
    for error in result.errors:
        items[error.item_id] = ItemAnswer(error.code or int(Code.UNKNOWN), error.message, error.worker_fault,
                                          error.reason)  # fmt: skip
    ids, rows = result.item_ids, result.item_rows
    if len(ids) != len(rows):
        raise ValueError(f"batch {result.batch_id}: {len(ids)} item ids but {len(rows)} item rows")
    outputs = [(t.name, t.datatype, split_buffers(t, rows)) for t in result.outputs]
    for index, item_id in enumerate(ids):
        tensors = [Tensor(name, datatype, *parts[index]) for name, datatype, parts in outputs]
        items[item_id] = ItemAnswer(outputs=tensors)
    forward_rows = result.forward_rows or result.executed_size
    return BatchAnswer(
        result.batch_id, items, forward_rows, result.execute_us / 1e6, queued_batches=result.queued_batches
    )
