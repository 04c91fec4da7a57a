"""The stored form of an `InferResult`: what result-cache entries and completed idempotency records hold.

A `sluice.v1.StoredResult` message (protos/sluice/v1/result.proto), not a client transport's response, so
the stores stay transport-free and a replay or a hit can be answered over any transport.

Invariants:
- `decode_result(encode_result(r), request_id=r.id) == replace(r, replayed=False)`: every field but the
  request id (a replay or a hit answers with the caller's own id) and `replayed` (a replay is never
  stored) comes back, and output bytes come back byte for byte.
- `decode_result` raises ValueError on anything that is not a well-formed stored result; the callers treat
  that as a miss (cache) or an unreadable record (idempotency), never as a result.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from sluice_inference.common.pb.sluice.v1 import result_pb2
from sluice_inference.router.calls import CacheOutcome, InferResult, ServedBy, Tensor


def encode_result(result: InferResult) -> bytes:
    """Serialize a result without its request id."""
    stored = result_pb2.StoredResult(
        model_name=result.model_name,
        model_version=result.model_version,
        cache="" if result.cache is None else result.cache.value,
    )
    for tensor in result.outputs:
        stored.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape, data=tensor.data)
    if result.served is not None:
        served = result.served
        stored.served.CopyFrom(
            result_pb2.StoredServing(
                worker_id=served.worker_id, batch_rows=served.batch_rows, queue_s=served.queue_s
            )
        )
    return stored.SerializeToString()


def decode_result(blob: bytes, *, request_id: str) -> InferResult:
    """The result in `blob`, answering request `request_id`; ValueError if `blob` is not a stored result."""
    try:
        stored = result_pb2.StoredResult.FromString(blob)
        cache = CacheOutcome(stored.cache) if stored.cache else None
    except (DecodeError, ValueError) as exc:
        raise ValueError(f"not a stored result: {exc}") from exc
    served = None
    if stored.HasField("served"):
        s = stored.served
        served = ServedBy(worker_id=s.worker_id, batch_rows=s.batch_rows, queue_s=s.queue_s)
    return InferResult(
        model_name=stored.model_name,
        model_version=stored.model_version,
        id=request_id,
        outputs=tuple(Tensor(t.name, t.datatype, tuple(t.shape), t.data) for t in stored.outputs),
        served=served,
        cache=cache,
    )
