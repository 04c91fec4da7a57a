"""An `InferCall` → the `DecodedRequest` the driver queues, validated against the registered model record;
and the driver's reply → the call's output tensors. Transport-free: the KServe protobuf half is
`router/kserve_codec.py`.

Decoding checks everything a worker would otherwise fail on — input names, datatypes, ranks, fixed dims,
batch size, buffer lengths, requested output names — so a malformed request costs no queue slot and no
device time, and gets INVALID_ARGUMENT naming the tensor. Typed values are converted to raw little-endian
bytes here, after those checks, so everything downstream sees one canonical encoding.

The driver seam: the data plane calls `Executor.infer(decoded, deadline, tenant, priority, arrival=...)`
and gets `outputs` (every output the model produced, canonical tensors) and `served` back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy.typing as npt

from sluice_inference.common.buckets import bucketed, row_cost
from sluice_inference.common.errors import InvalidArgument
from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.common.tensors import (
    DATATYPES,
    MAX_SHAPE_SPAN,
    dtype_of,
    from_raw,
    from_values,
    shown_shape,
)
from sluice_inference.router.calls import InferCall, InputTensor, ServedBy, Tensor
from sluice_inference.router.policy.cache_keys import ParamValue, TensorLike
from sluice_inference.router.policy.lanes import LaneKey
from sluice_inference.router.policy.tenants import Tenant

__all__ = [
    "DecodeLimits",
    "DecodedRequest",
    "Executor",
    "ExecutorReply",
    "ServedBy",  # defined in router/calls.py; the driver imports it from here
    "decode_call",
    "int_parameter",
    "plain_parameters",
    "requested_outputs",
    "timeout_parameter",
]

MICROSECONDS = 1e-6
TENSOR_OVERHEAD_BYTES = 64
"""Framing of one output tensor in a response (name, datatype, shape): counted in the size check."""


@dataclass(frozen=True)
class DecodeLimits:
    """Edge bounds a request is checked against before it costs anything (router settings)."""

    max_response_bytes: int = 16 * 1024 * 1024
    """rows x requested outputs x bytes must fit the client port's message limit."""


@dataclass(slots=True)
class DecodedRequest:
    """A validated inference request, ready to queue: what the driver takes. Treated as immutable, and not
    `frozen` for the reason `InputTensor` gives (router/calls.py): one is built per request."""

    record: ModelRecord
    client_id: str
    inputs: tuple[Tensor, ...]
    """Canonical inputs sorted by name: the bytes the worker stream carries, joined with the other items'
    of a batch (common/batch_tensors.py), with no per-item message in between."""
    outputs: tuple[str, ...]
    rows: int
    lane: LaneKey
    timeout_s: float | None
    cost: int
    """Rows times the padded length of the variable dims: what `max_batch_cost` limits."""
    input_bytes: int
    """Bytes of the canonical input tensors (the data plane and the driver both ask)."""
    response_bytes: int = 0
    """Upper estimate of the response's size (variable output dims count as 1)."""


class ExecutorReply(Protocol):
    """What the driver answers for one request: every output the model produced, and how it ran."""

    @property
    def outputs(self) -> Sequence[TensorLike]:
        """Output tensors (canonical bytes), every output of the model."""
        ...

    @property
    def served(self) -> ServedBy:
        """Worker, batch rows and queue time."""
        ...


class Executor(Protocol):
    """The driver seam: queue a decoded request, batch it, run it on a worker (router/driver.py)."""

    async def infer(
        self, decoded: DecodedRequest, deadline: float, tenant: Tenant, priority: int, *, arrival: float
    ) -> ExecutorReply:
        """The reply, or a SluiceError (shed, expired, worker lost, item failed, ...). `arrival` is when the
        call reached the router: the whole budget its client gave is `deadline - arrival`."""
        ...


def plain_parameters(parameters: Mapping[str, ParamValue | None]) -> dict[str, ParamValue]:
    """The parameters that carry a value: what cache keys and fingerprints hash."""
    return {name: value for name, value in parameters.items() if value is not None}


def int_parameter(parameters: Mapping[str, ParamValue | None], name: str) -> int | None:
    """An integer request parameter (e.g. `priority`), None when absent; InvalidArgument if not an int."""
    if name not in parameters:
        return None
    value = parameters[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f'parameters["{name}"] must be an integer', reason=f"bad_{name}")
    return value


def timeout_parameter(parameters: Mapping[str, ParamValue | None]) -> float | None:
    """`parameters["timeout"]` in microseconds (Triton's convention), as seconds; a positive whole number.
    A longer one than `router.max_timeout_s` is clamped with the deadline, like a long gRPC deadline
    (router/policy/deadline_budget.py)."""
    if "timeout" not in parameters:
        return None
    value = parameters["timeout"]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(
            'parameters["timeout"] must be a positive whole number of microseconds', reason="bad_timeout"
        )
    return value * MICROSECONDS


def _dims(spec: TensorSpec) -> str:
    return ", ".join(map(str, spec.dims))


def _check_shape(spec: TensorSpec, shape: Sequence[int], max_batch_size: int) -> int:
    if len(shape) != len(spec.dims) + 1:
        raise InvalidArgument(
            f"input {spec.name!r}: shape {shown_shape(shape)} must be [batch, {_dims(spec)}]",
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
                f"input {spec.name!r}: shape {shown_shape(shape)} does not match [-1, {_dims(spec)}]",
                reason="bad_shape",
            )
    return rows


def _decode_input(spec: TensorSpec, tensor: InputTensor) -> Tensor:
    if tensor.datatype != spec.datatype:
        raise InvalidArgument(
            f"input {spec.name!r}: datatype {tensor.datatype[:32]!r}, model expects {spec.datatype!r}",
            reason="bad_datatype",
        )
    shape = tuple(tensor.shape)
    if tensor.data is not None:
        values = from_raw(spec.name, spec.datatype, shape, tensor.data)  # validates the length
        data = tensor.data
    else:
        values = from_values(spec.name, spec.datatype, shape, tensor.values)
        data = values.tobytes()
    if spec.range is not None:
        _check_range(spec, values)
    return Tensor(spec.name, spec.datatype, shape, data)


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


def _check_outputs(
    outputs: tuple[str, ...], record: ModelRecord, output_names: frozenset[str]
) -> tuple[str, ...]:
    """Requested output names: known, and each named once (listing one 200,000 times once made the
    router copy it as often)."""
    if not outputs:
        return outputs
    unknown = [name for name in outputs if name not in output_names]
    if unknown:
        raise InvalidArgument(
            f"model {record.name!r} has no output {unknown[0][:64]!r} (outputs: {sorted(output_names)})",
            reason="bad_outputs",
        )
    if len(set(outputs)) != len(outputs):
        raise InvalidArgument("requested outputs must be distinct", reason="duplicate_outputs")
    return outputs


@dataclass(frozen=True, slots=True)
class _Layout:
    """What decoding needs of one model record, worked out once per record rather than per request (issue
    17: a validator compiled per model version). Fixed-shape inputs sent raw — the common case — then cost
    a name check, a shape check and a length check each; anything else takes the general path."""

    specs: dict[str, TensorSpec]
    names: list[str]
    """The input names, sorted: what a request's names must equal."""
    output_names: frozenset[str]
    output_row_bytes: tuple[tuple[str, int], ...]
    """Each output's bytes per row (variable dims count as 1), in the record's order."""
    all_outputs_row_bytes: int
    """The sum of `output_row_bytes`: a request that names no outputs gets every one."""
    raw_row_bytes: dict[str, int]
    """Bytes per row of each input whose length can be checked as rows times this: fixed dims, no value
    range to check, and no batch the record admits spanning more than `MAX_SHAPE_SPAN` elements."""
    fixed_lane: LaneKey | None
    """The lane of every request when no input has a variable dim (padding changes nothing then)."""
    fixed_row_cost: int

    def response_bytes(self, rows: int, outputs: tuple[str, ...]) -> int:
        """Upper estimate of the response to `rows` rows asking for `outputs` (none: every output)."""
        if not outputs:
            return rows * self.all_outputs_row_bytes + TENSOR_OVERHEAD_BYTES * len(self.output_row_bytes)
        return sum(
            rows * per_row + TENSOR_OVERHEAD_BYTES
            for name, per_row in self.output_row_bytes
            if name in outputs
        )


_LAYOUTS: dict[int, tuple[ModelRecord, _Layout]] = {}
"""Layouts by record identity (a record is immutable; hashing one would cost more than decoding). The
entry keeps its record alive, so an id is not reused while its layout is here."""
_MAX_LAYOUTS = 256
"""Bound on remembered layouts: the catalog replaces records when workers re-register."""


def _layout(record: ModelRecord) -> _Layout:
    entry = _LAYOUTS.get(id(record))
    if entry is not None and entry[0] is record:
        return entry[1]
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.clear()
    specs = {spec.name: spec for spec in record.inputs}
    output_row_bytes = []
    for spec in record.outputs:
        per_row = dtype_of(spec.datatype, tensor=spec.name).itemsize
        for dim in spec.dims:
            per_row *= max(1, dim)
        output_row_bytes.append((spec.name, per_row))
    raw_row_bytes = {}
    for spec in record.inputs:
        if spec.range is not None or spec.datatype not in DATATYPES or any(d < 0 for d in spec.dims):
            continue
        span = record.max_batch_size * math.prod(max(d, 1) for d in spec.dims)
        if span <= MAX_SHAPE_SPAN:
            raw_row_bytes[spec.name] = dtype_of(spec.datatype, tensor=spec.name).itemsize * math.prod(
                spec.dims
            )
    fixed = all(d >= 0 for spec in record.inputs for d in spec.dims)
    dims = tuple(sorted((spec.name, spec.dims) for spec in record.inputs))
    layout = _Layout(
        specs=specs,
        names=sorted(specs),
        output_names=frozenset(spec.name for spec in record.outputs),
        output_row_bytes=tuple(output_row_bytes),
        all_outputs_row_bytes=sum(per_row for _, per_row in output_row_bytes),
        raw_row_bytes=raw_row_bytes,
        fixed_lane=LaneKey(record.name, record.version, dims) if fixed else None,
        fixed_row_cost=row_cost((specs[name].dims, shape) for name, shape in dims) if fixed else 0,
    )
    _LAYOUTS[id(record)] = (record, layout)
    return layout


def decode_call(
    call: InferCall, record: ModelRecord, limits: DecodeLimits = DecodeLimits()
) -> DecodedRequest:
    """Validate a call against the model and the edge limits, and convert it; InvalidArgument on any
    mismatch, before the request costs a queue slot or device time."""
    layout = _layout(record)
    specs = layout.specs
    given = [t.name for t in call.inputs]
    if sorted(given) != layout.names or len(set(given)) != len(given):
        shown = [name[:64] for name in given[:8]] + (["..."] if len(given) > 8 else [])
        raise InvalidArgument(
            f"model {record.name!r} takes inputs {layout.names}, request has {shown}", reason="bad_inputs"
        )
    outputs = _check_outputs(call.outputs, record, layout.output_names)
    timeout_s = timeout_parameter(call.parameters) if call.parameters else None
    if call.defect is not None:
        raise call.defect
    rows_seen: set[int] = set()
    decoded = []
    for tensor in call.inputs:
        spec = specs[tensor.name]
        rows = _check_shape(spec, tensor.shape, record.max_batch_size)
        rows_seen.add(rows)
        row_bytes = layout.raw_row_bytes.get(tensor.name)
        data = tensor.data
        if row_bytes is not None and data is not None and tensor.datatype == spec.datatype:
            if len(data) != rows * row_bytes:
                from_raw(spec.name, spec.datatype, tensor.shape, data)  # raises its bad_size error
            decoded.append(Tensor(spec.name, spec.datatype, tensor.shape, data))
        else:
            decoded.append(_decode_input(spec, tensor))
    if len(rows_seen) != 1:
        raise InvalidArgument(
            f"inputs disagree on the batch dimension: {sorted(rows_seen)}", reason="bad_shape"
        )
    rows = rows_seen.pop()
    expected = layout.response_bytes(rows, outputs)
    if expected > limits.max_response_bytes:
        raise InvalidArgument(
            f"the response would be ~{expected} bytes, over the {limits.max_response_bytes}-byte message "
            "limit (send fewer rows or request fewer outputs)",
            reason="response_too_large",
        )
    if len(decoded) > 1:
        decoded.sort(key=lambda t: t.name)
    if layout.fixed_lane is not None:
        lane, cost = layout.fixed_lane, rows * layout.fixed_row_cost
    else:
        padded = {
            t.name: bucketed(specs[t.name].dims, t.shape[1:], record.buckets.get(t.name, ())) for t in decoded
        }
        lane = LaneKey(record.name, record.version, tuple(sorted(padded.items())))
        cost = rows * row_cost((specs[name].dims, dims) for name, dims in padded.items())
    return DecodedRequest(
        record=record,
        client_id=call.id,
        inputs=tuple(decoded),
        outputs=outputs,
        rows=rows,
        lane=lane,
        cost=cost,
        timeout_s=timeout_s,
        input_bytes=sum(len(t.data) for t in decoded) if len(decoded) > 1 else len(decoded[0].data),
        response_bytes=expected,
    )


def requested_outputs(decoded: DecodedRequest, outputs: Sequence[TensorLike]) -> tuple[Tensor, ...]:
    """The outputs a request named, in the order it named them (all of them when it named none), as
    canonical tensors. Workers return every output: a batch mixes requests that asked for different ones."""
    if decoded.outputs:
        by_name = {t.name: t for t in outputs}
        outputs = [by_name[name] for name in decoded.outputs if name in by_name]
    return tuple(_canonical(t) for t in outputs)


def _canonical(tensor: TensorLike) -> Tensor:
    """A reply's tensor as the router's own type (the driver's already are: no copy then)."""
    if isinstance(tensor, Tensor):
        return tensor
    return Tensor(tensor.name, tensor.datatype, tuple(tensor.shape), bytes(tensor.data))
