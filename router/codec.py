"""KServe v2 messages ↔ the router's domain objects, validated against the registered model record.

Decoding checks everything a worker would otherwise fail on — input names, datatypes, ranks, fixed dims,
batch size, buffer lengths, requested output names — so a malformed request costs no queue slot and no
device time, and gets INVALID_ARGUMENT naming the tensor. Typed `contents` are converted to raw
little-endian bytes here, so everything downstream sees one canonical encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from common.buckets import bucketed, padded_cost
from common.errors import InvalidArgument
from common.pb.inference import grpc_service_pb2 as kserve
from common.pb.sluice.v1 import worker_pb2
from common.records import ModelRecord, TensorSpec
from common.tensors import dtype_of, from_contents, from_raw
from router.policy.lanes import LaneKey

MICROSECONDS = 1e-6
TENSOR_OVERHEAD_BYTES = 64
"""Framing of one output tensor in a response (name, datatype, shape): counted in the size check."""


@dataclass(frozen=True)
class DecodeLimits:
    """Edge bounds a request is checked against before it costs anything (router settings)."""

    max_timeout_s: float = 300.0
    """`parameters["timeout"]` must lie in (0, max_timeout_s]."""
    max_response_bytes: int = 16 * 1024 * 1024
    """rows x requested outputs x bytes must fit the client port's message limit."""


@dataclass(frozen=True)
class DecodedRequest:
    """A validated inference request, ready to queue."""

    record: ModelRecord
    client_id: str
    inputs: tuple[worker_pb2.Tensor, ...]
    outputs: tuple[str, ...]
    rows: int
    lane: LaneKey
    timeout_s: float | None
    cost: int
    """Rows times the padded length of the variable dims: what `max_batch_cost` limits."""
    response_bytes: int = 0
    """Upper estimate of the response's size (variable output dims count as 1)."""

    @property
    def input_bytes(self) -> int:
        """Bytes of the canonical input tensors."""
        return sum(len(t.data) for t in self.inputs)


ParamValue = bool | int | float | str


def _param_value(param: kserve.InferParameter) -> ParamValue | None:
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


def plain_parameters(request: kserve.ModelInferRequest) -> dict[str, ParamValue]:
    """Request parameters as plain typed values (unset oneofs dropped)."""
    values = {name: _param_value(param) for name, param in request.parameters.items()}
    return {name: value for name, value in values.items() if value is not None}


def int_parameter(request: kserve.ModelInferRequest, name: str) -> int | None:
    """An integer request parameter (e.g. `priority`), None when absent; InvalidArgument if not an int."""
    if name not in request.parameters:
        return None
    value = _param_value(request.parameters[name])
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f'parameters["{name}"] must be an integer', reason=f"bad_{name}")
    return value


def timeout_parameter(request: kserve.ModelInferRequest, max_timeout_s: float) -> float | None:
    """`parameters["timeout"]` in microseconds (Triton's convention), as seconds; it must lie in
    (0, max_timeout_s] (a uint64 of 2^64-1 once overflowed the router's batch budget)."""
    if "timeout" not in request.parameters:
        return None
    value = _param_value(request.parameters["timeout"])
    longest_us = round(max_timeout_s / MICROSECONDS)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= longest_us:
        raise InvalidArgument(
            f'parameters["timeout"] must be a whole number of microseconds in 1..{longest_us}',
            reason="bad_timeout",
        )
    return value * MICROSECONDS


def _shown(shape: list[int]) -> str:
    """A shape for an error message, cut short: a hostile shape can have millions of dims."""
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...] ({len(shape)} dims)"


def _check_shape(spec: TensorSpec, shape: list[int], max_batch_size: int) -> int:
    if len(shape) != len(spec.dims) + 1:
        raise InvalidArgument(
            f"input {spec.name!r}: shape {_shown(shape)} must be [batch, {', '.join(map(str, spec.dims))}]",
            reason="bad_shape",
        )
    rows = shape[0]
    if not 1 <= rows <= max_batch_size:
        raise InvalidArgument(
            f"input {spec.name!r}: batch dimension {rows} must be between 1 and {max_batch_size}",
            reason="bad_shape",
        )
    for want, got in zip(spec.dims, shape[1:], strict=True):
        if (want >= 0 and got != want) or got < 0:
            raise InvalidArgument(
                f"input {spec.name!r}: shape {shape} does not match [-1, {', '.join(map(str, spec.dims))}]",
                reason="bad_shape",
            )
    return rows


def _decode_input(
    spec: TensorSpec, tensor: kserve.ModelInferRequest.InferInputTensor, raw: bytes | None
) -> worker_pb2.Tensor:
    if tensor.datatype != spec.datatype:
        raise InvalidArgument(
            f"input {spec.name!r}: datatype {tensor.datatype!r}, model expects {spec.datatype!r}",
            reason="bad_datatype",
        )
    shape = list(tensor.shape)
    if raw is not None:
        values = from_raw(spec.name, spec.datatype, shape, raw)  # validates the length
        data = raw
    else:
        values = from_contents(spec.name, spec.datatype, shape, tensor.contents)
        data = values.tobytes()
    if spec.range is not None:
        _check_range(spec, values)
    return worker_pb2.Tensor(name=spec.name, datatype=spec.datatype, shape=shape, data=data)


def _check_range(spec: TensorSpec, values: npt.NDArray[Any]) -> None:
    """Every element within the declared inclusive range: an out-of-range token id is the client's
    mistake (INVALID_ARGUMENT here), not a device error on the worker."""
    assert spec.range is not None
    low, high = spec.range
    if values.size and (values.min() < low or values.max() > high):
        raise InvalidArgument(
            f"input {spec.name!r}: values must lie in [{low}, {high}], got [{values.min()}, {values.max()}]",
            reason="out_of_range",
        )


def response_bytes(record: ModelRecord, rows: int, outputs: tuple[str, ...]) -> int:
    """Upper estimate of a response's size: rows x each requested output's bytes per row (variable dims
    count as 1), plus framing."""
    total = 0
    for spec in record.outputs:
        if outputs and spec.name not in outputs:
            continue
        per_row = dtype_of(spec.datatype, tensor=spec.name).itemsize
        for dim in spec.dims:
            per_row *= max(1, dim)
        total += rows * per_row + TENSOR_OVERHEAD_BYTES
    return total


def _requested_outputs(request: kserve.ModelInferRequest, record: ModelRecord) -> tuple[str, ...]:
    """Requested output names: known, and each named once (listing one 200,000 times once made the
    router copy it as often)."""
    output_names = {spec.name for spec in record.outputs}
    outputs = tuple(o.name for o in request.outputs)
    unknown = [name for name in outputs if name not in output_names]
    if unknown:
        raise InvalidArgument(
            f"model {record.name!r} has no output {unknown[0][:64]!r} (outputs: {sorted(output_names)})",
            reason="bad_outputs",
        )
    if len(set(outputs)) != len(outputs):
        raise InvalidArgument("requested outputs must be distinct", reason="duplicate_outputs")
    return outputs


def decode_infer_request(
    request: kserve.ModelInferRequest, record: ModelRecord, limits: DecodeLimits = DecodeLimits()
) -> DecodedRequest:
    """Validate a ModelInferRequest against the model and the edge limits, and convert it;
    InvalidArgument on any mismatch, before the request costs a queue slot or device time."""
    specs = {spec.name: spec for spec in record.inputs}
    given = [t.name for t in request.inputs]
    if sorted(given) != sorted(specs) or len(set(given)) != len(given):
        shown = [name[:64] for name in given[:8]] + (["..."] if len(given) > 8 else [])
        raise InvalidArgument(
            f"model {record.name!r} takes inputs {sorted(specs)}, request has {shown}", reason="bad_inputs"
        )
    outputs = _requested_outputs(request, record)
    timeout_s = timeout_parameter(request, limits.max_timeout_s)
    raws = list(request.raw_input_contents)
    if raws and len(raws) != len(request.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raws)} buffers for {len(request.inputs)} inputs",
            reason="bad_inputs",
        )
    rows_seen: set[int] = set()
    decoded = []
    for index, tensor in enumerate(request.inputs):
        spec = specs[tensor.name]
        rows_seen.add(_check_shape(spec, list(tensor.shape), record.max_batch_size))
        decoded.append(_decode_input(spec, tensor, raws[index] if raws else None))
    if len(rows_seen) != 1:
        raise InvalidArgument(
            f"inputs disagree on the batch dimension: {sorted(rows_seen)}", reason="bad_shape"
        )
    rows = rows_seen.pop()
    expected = response_bytes(record, rows, outputs)
    if expected > limits.max_response_bytes:
        raise InvalidArgument(
            f"the response would be ~{expected} bytes, over the {limits.max_response_bytes}-byte message "
            "limit (send fewer rows or request fewer outputs)",
            reason="response_too_large",
        )
    decoded.sort(key=lambda t: t.name)
    padded = {
        t.name: bucketed(specs[t.name].dims, t.shape[1:], record.buckets.get(t.name, ())) for t in decoded
    }
    lane = LaneKey(record.name, record.version, tuple(sorted(padded.items())))
    cost = sum(padded_cost(specs[name].dims, dims) for name, dims in padded.items())
    return DecodedRequest(
        record=record,
        client_id=request.id,
        inputs=tuple(decoded),
        outputs=outputs,
        rows=rows,
        lane=lane,
        cost=rows * max(1, cost),
        timeout_s=timeout_s,
        response_bytes=expected,
    )


@dataclass(frozen=True)
class ServedBy:
    """How a request was served, reported in response parameters."""

    worker_id: str
    batch_rows: int
    queue_s: float


def encode_infer_response(
    decoded: DecodedRequest, outputs: list[worker_pb2.Tensor], served: ServedBy
) -> kserve.ModelInferResponse:
    """A ModelInferResponse with raw output buffers and Sluice's response parameters.

    Workers return every output (a batch mixes requests that asked for different ones); the outputs a
    request named are picked here, in the order it named them.
    """
    response = kserve.ModelInferResponse(
        model_name=decoded.record.name, model_version=decoded.record.version, id=decoded.client_id
    )
    if decoded.outputs:
        by_name = {t.name: t for t in outputs}
        outputs = [by_name[name] for name in decoded.outputs if name in by_name]
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    params = response.parameters
    params["sluice_batch_size"].int64_param = served.batch_rows
    params["sluice_queue_us"].int64_param = round(served.queue_s * 1e6)
    params["sluice_worker"].string_param = served.worker_id
    return response


def model_metadata(record: ModelRecord, versions: list[str]) -> kserve.ModelMetadataResponse:
    """ModelMetadata from a registration: shapes include the batch dimension as -1."""
    response = kserve.ModelMetadataResponse(name=record.name, versions=versions, platform=record.platform)
    for spec in record.inputs:
        response.inputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.dims])
    for spec in record.outputs:
        response.outputs.add(name=spec.name, datatype=spec.datatype, shape=[-1, *spec.dims])
    return response
