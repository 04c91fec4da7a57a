"""KServe v2 gRPC messages ↔ the data plane's domain objects (`router/calls.py`): the only router code
besides the servicer that reads or builds `inference.*` messages.

Conversion never raises and never checks against a model: validation is the data plane's
(`router/codec.py`), so it happens in the same order, and is accounted the same way, for every transport.
Inputs are passed as sent — a raw buffer, or the typed `contents` field the declared datatype uses
(the protocol's table, `sluice_inference.common.tensors.CONTENTS_FIELD`) — and made
canonical only once validated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry.context import Context

from sluice_inference.common.errors import InvalidArgument, Unauthenticated
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.records import ModelRecord
from sluice_inference.common.tensors import CONTENTS_FIELD
from sluice_inference.router.calls import InferCall, InferResult, InputTensor, TypedValue
from sluice_inference.router.policy.cache_keys import ParamValue

IDEMPOTENCY_HEADER = "idempotency-key"
Metadata = Iterable[tuple[str, Any]] | None


def metadata_value(metadata: Metadata, name: str) -> str | None:
    """The first value of a metadata key, as text; None when absent."""
    for key, value in metadata or ():
        if key == name:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def api_key(metadata: Metadata) -> str | None:
    """The key in `authorization: Bearer <key>`, or None when absent."""
    text = metadata_value(metadata, "authorization")
    if text is None:
        return None
    scheme, _, token = text.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata must be 'Bearer <api key>'", reason="bad_auth_header")
    return token.strip()


def _param_value(param: kserve.InferParameter) -> ParamValue | None:
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


def _typed_values(tensor: kserve.ModelInferRequest.InferInputTensor) -> Sequence[TypedValue] | None:
    """The typed `contents` field the declared datatype uses (a repeated field: a sequence, not a copy);
    None for a datatype that has none."""
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        return None
    values: Sequence[TypedValue] = getattr(tensor.contents, field)
    return values


def call_from_request(
    request: kserve.ModelInferRequest,
    *,
    metadata: Metadata,
    time_remaining_s: float | None,
    trace_parent: Context | None = None,
) -> InferCall:
    """The domain call a ModelInferRequest (with its call's metadata and deadline) asks for. Raises only
    for an `authorization` header that is not 'Bearer <key>' (the client port's gate refuses those first)."""
    raws = request.raw_input_contents
    defect = None
    if raws and len(raws) != len(request.inputs):
        defect = InvalidArgument(
            f"raw_input_contents has {len(raws)} buffers for {len(request.inputs)} inputs",
            reason="bad_inputs",
        )
    paired = bool(raws) and defect is None
    inputs = tuple(
        InputTensor(
            name=tensor.name,
            datatype=tensor.datatype,
            shape=tuple(tensor.shape),
            data=raws[index] if paired else None,
            values=None if raws else _typed_values(tensor),
        )
        for index, tensor in enumerate(request.inputs)
    )
    return InferCall(
        model_name=request.model_name,
        model_version=request.model_version,
        id=request.id,
        inputs=inputs,
        outputs=tuple(o.name for o in request.outputs),
        parameters={name: _param_value(param) for name, param in request.parameters.items()},
        api_key=api_key(metadata),
        idempotency_key=metadata_value(metadata, IDEMPOTENCY_HEADER),
        time_remaining_s=time_remaining_s,
        body_bytes=request.ByteSize(),
        defect=defect,
        trace_parent=trace_parent,
    )


def response_from_result(result: InferResult) -> kserve.ModelInferResponse:
    """A ModelInferResponse with raw output buffers and Sluice's response parameters (docs/design.md §4):
    `sluice_batch_size`, `sluice_queue_us`, `sluice_worker` when a worker served it, `sluice_cache` when
    the model is cacheable, `sluice_replayed` for an idempotent replay."""
    response = kserve.ModelInferResponse(
        model_name=result.model_name, model_version=result.model_version, id=result.id
    )
    for tensor in result.outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    params = response.parameters
    if result.served is not None:
        params["sluice_batch_size"].int64_param = result.served.batch_rows
        params["sluice_queue_us"].int64_param = round(result.served.queue_s * 1e6)
        params["sluice_worker"].string_param = result.served.worker_id
    if result.cache is not None:
        params["sluice_cache"].string_param = result.cache.value
    if result.replayed:
        params["sluice_replayed"].bool_param = True
    return response


def model_metadata(record: ModelRecord, versions: list[str]) -> kserve.ModelMetadataResponse:
    """ModelMetadata from a registration: shapes include the batch dimension as -1."""
    response = kserve.ModelMetadataResponse(name=record.name, versions=versions, platform=record.platform)
    for spec in record.inputs:
        response.inputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.dims])
    for spec in record.outputs:
        response.outputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.dims])
    return response
