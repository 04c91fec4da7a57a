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
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context

from sluice_inference.common.errors import InvalidArgument, Unauthenticated
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.records import ModelRecord
from sluice_inference.common.tensors import CONTENTS_FIELD
from sluice_inference.router.calls import InferCall, InferResult, InputTensor, TypedValue
from sluice_inference.router.policy.cache_keys import ParamValue

IDEMPOTENCY_HEADER = "idempotency-key"
TRACE_HEADERS = ("traceparent", "tracestate")
Metadata = Iterable[tuple[str, Any]] | None


@dataclass(frozen=True, slots=True)
class CallHead:
    """What the router reads from a call's metadata, read in one pass (`read_head`): it was read two or
    three times per call, a loop over every entry each time."""

    authorization: str | None = None
    idempotency_key: str | None = None
    trace: dict[str, str] | None = None
    """W3C trace context headers, when the caller sent any."""

    @property
    def api_key(self) -> str | None:
        """The key in `authorization: Bearer <key>`, or None when absent; Unauthenticated for another form."""
        return _bearer(self.authorization)


def read_head(metadata: Metadata) -> CallHead:
    """The `CallHead` of a call's metadata."""
    authorization = idempotency_key = None
    trace: dict[str, str] | None = None
    for key, value in metadata or ():
        if key == "authorization":
            authorization = authorization if authorization is not None else _text(value)
        elif key == IDEMPOTENCY_HEADER:
            idempotency_key = idempotency_key if idempotency_key is not None else _text(value)
        elif key in TRACE_HEADERS:
            trace = trace if trace is not None else {}
            trace.setdefault(key, _text(value))
    return CallHead(authorization, idempotency_key, trace)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def metadata_value(metadata: Metadata, name: str) -> str | None:
    """The first value of a metadata key, as text; None when absent."""
    for key, value in metadata or ():
        if key == name:
            return _text(value)
    return None


def api_key(metadata: Metadata) -> str | None:
    """The key in `authorization: Bearer <key>`, or None when absent."""
    return _bearer(metadata_value(metadata, "authorization"))


def _bearer(text: str | None) -> str | None:
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


def _raw_input(tensor: kserve.ModelInferRequest.InferInputTensor, data: bytes | None) -> InputTensor:
    return InputTensor(tensor.name, tensor.datatype, tuple(tensor.shape[:]), data)


def _typed_input(tensor: kserve.ModelInferRequest.InferInputTensor) -> InputTensor:
    return InputTensor(tensor.name, tensor.datatype, tuple(tensor.shape[:]), None, _typed_values(tensor))


def call_from_request(
    request: kserve.ModelInferRequest,
    *,
    metadata: Metadata | CallHead,
    time_remaining_s: float | None,
    trace_parent: Context | None = None,
    body_bytes: int | None = None,
) -> InferCall:
    """The domain call a ModelInferRequest (with its call's metadata, or its head already read, and
    deadline) asks for; `body_bytes` is the size of the body as received, when the transport knows it
    (else it is computed). Raises only for an `authorization` header that is not 'Bearer <key>' (the
    client port's gate refuses those first)."""
    head = metadata if isinstance(metadata, CallHead) else read_head(metadata)
    raws = request.raw_input_contents
    tensors = request.inputs
    count = len(tensors)
    defect = None
    # Lists by index, not generators or iteration over the repeated fields: a generator frame, and an
    # iterator over a repeated protobuf field, each cost more than the indexing (~1 µs a request);
    # `tuple(shape[:])` half of `tuple(shape)`. Empty fields are skipped.
    if not raws:
        inputs = tuple([_typed_input(tensors[i]) for i in range(count)])
    elif len(raws) == count:
        inputs = tuple([_raw_input(tensors[i], raws[i]) for i in range(count)])
    else:
        defect = InvalidArgument(
            f"raw_input_contents has {len(raws)} buffers for {count} inputs", reason="bad_inputs"
        )
        inputs = tuple([_raw_input(tensors[i], None) for i in range(count)])
    outputs = request.outputs
    parameters = request.parameters
    return InferCall(
        model_name=request.model_name,
        model_version=request.model_version,
        id=request.id,
        inputs=inputs,
        outputs=tuple([outputs[i].name for i in range(len(outputs))]) if outputs else (),
        parameters={name: _param_value(param) for name, param in parameters.items()} if parameters else {},
        api_key=head.api_key,
        idempotency_key=head.idempotency_key,
        time_remaining_s=time_remaining_s,
        body_bytes=request.ByteSize() if body_bytes is None else body_bytes,
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
