"""Cache keys and request fingerprints: SHA-256 over one unambiguous encoding of a request.

Invariants (why they hold):
- Two requests get the same cache key iff they agree on scope, model, resolved version, model digest,
  every input's (name, datatype, shape, bytes), the requested outputs and every parameter not in
  `OUTPUT_AFFECTING_EXCLUDED`. Every field is length-prefixed, so no two different field lists encode to
  the same bytes ("ab"+"c" ≠ "a"+"bc"); parameter values carry a type tag, so `True`, `1`, `1.0` and "1"
  differ.
- Inputs are sorted by name (their order in a request carries no meaning); requested outputs keep their
  order, because the response lists outputs in the order they were requested and a cached response must be
  byte-identical to a fresh one.
- Input bytes are the canonical raw little-endian buffers `sluice_inference.router.codec` produces
  (typed `contents` are converted there), so a request sent raw and the same request sent typed share a key.
- A new model digest yields new keys: results of an old artifact are never served for a new one.
- Scope is `"shared"` for models declared shareable, else `"tenant:<name>"`: tenant names cannot collide
  with the shared scope or with each other, so tenant B never reads tenant A's entry.
- Cache keys and fingerprints use different domain-separation tags, so one can never equal the other; the
  format version is hashed too, so changing the encoding changes every key instead of aliasing old ones.

Digests, never raw inputs, leave this module: the shared Redis tier sees only these hex strings.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

ParamValue = bool | int | float | str

SHARED_SCOPE: Final = "shared"
TENANT_SCOPE_PREFIX: Final = "tenant:"

OUTPUT_AFFECTING_EXCLUDED: Final[frozenset[str]] = frozenset({"priority", "timeout", "cache"})
"""Request parameters that cannot change a model's output and so stay out of cache keys: `priority` and
`timeout` only decide when (and whether) the request runs, `cache` only whether the cache is consulted.
Every other parameter counts, including ones Sluice does not know: a custom parameter may reach the model,
and a missed hit costs less than a wrong answer."""

FINGERPRINT_EXCLUDED: Final[frozenset[str]] = frozenset({"priority", "timeout", "cache"})
"""Request parameters that do not make a retry a "different request" for idempotency: a client retrying
with the time it has left, another priority or the cache bypassed is repeating the same request."""

_CACHE_KEY_TAG: Final = b"sluice/cache-key"
_FINGERPRINT_TAG: Final = b"sluice/request-fingerprint"
_FORMAT_VERSION: Final = 1


@dataclass(frozen=True)
class TensorBytes:
    """One input in canonical form: raw little-endian `data` of `datatype` with `shape` (batch dim first)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes


class TensorLike(Protocol):
    """What `tensors_from` reads: the fields of a `worker_pb2.Tensor` (no protobuf import needed here)."""

    @property
    def name(self) -> str:
        """Input name."""
        ...

    @property
    def datatype(self) -> str:
        """Protocol datatype, e.g. "FP32"."""
        ...

    @property
    def shape(self) -> Sequence[int]:
        """Dims including the batch dim."""
        ...

    @property
    def data(self) -> bytes:
        """Raw little-endian elements."""
        ...


def tensors_from(tensors: Iterable[TensorLike]) -> tuple[TensorBytes, ...]:
    """Canonical inputs from decoded request tensors (e.g. `DecodedRequest.inputs`)."""
    return tuple(TensorBytes(t.name, t.datatype, tuple(t.shape), bytes(t.data)) for t in tensors)


def cache_scope(tenant: str, *, shared: bool) -> str:
    """The `scope` for `cache_key`: "shared" for shareable models, else "tenant:<tenant>"."""
    return SHARED_SCOPE if shared else TENANT_SCOPE_PREFIX + tenant


class _Encoder:
    """Feeds length-prefixed fields into SHA-256; the prefix makes every field boundary explicit."""

    def __init__(self, tag: bytes) -> None:
        self._hash = hashlib.sha256()
        self.raw(tag)
        self.integer(_FORMAT_VERSION)

    def raw(self, data: bytes) -> None:
        self._hash.update(struct.pack(">Q", len(data)))
        self._hash.update(data)

    def text(self, value: str) -> None:
        self.raw(value.encode("utf-8"))

    def integer(self, value: int) -> None:
        self.text(str(value))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _encode_inputs(enc: _Encoder, inputs: Sequence[TensorBytes]) -> None:
    ordered = sorted(inputs, key=lambda t: t.name)
    names = [t.name for t in ordered]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate input names {names}: a request names each input once")
    enc.integer(len(ordered))
    for tensor in ordered:
        enc.text(tensor.name)
        enc.text(tensor.datatype)
        enc.integer(len(tensor.shape))
        for dim in tensor.shape:
            enc.integer(dim)
        enc.raw(tensor.data)


def _encode_value(enc: _Encoder, value: ParamValue) -> None:
    # bool before int: bool is an int subclass, and True must not equal 1.
    if isinstance(value, bool):
        enc.text("b1" if value else "b0")
    elif isinstance(value, int):
        enc.text(f"i{value}")
    elif isinstance(value, float):
        enc.text(f"f{value.hex()}")  # exact: two floats share a hex form iff they are the same double
    else:
        enc.text(f"s{value}")


def _encode_parameters(enc: _Encoder, parameters: Mapping[str, ParamValue], excluded: frozenset[str]) -> None:
    counted = sorted(((k, v) for k, v in parameters.items() if k not in excluded), key=lambda kv: kv[0])
    enc.integer(len(counted))
    for name, value in counted:
        enc.text(name)
        _encode_value(enc, value)


def _encode_outputs(enc: _Encoder, outputs: Sequence[str]) -> None:
    enc.integer(len(outputs))
    for name in outputs:
        enc.text(name)


def _check_scope(scope: str) -> None:
    if scope != SHARED_SCOPE and not scope.startswith(TENANT_SCOPE_PREFIX):
        raise ValueError(
            f"cache scope {scope!r} must be {SHARED_SCOPE!r} or start with {TENANT_SCOPE_PREFIX!r}"
        )


def cache_key(
    *,
    scope: str,
    model: str,
    version: str,
    model_digest: str,
    inputs: Sequence[TensorBytes],
    outputs: Sequence[str],
    parameters: Mapping[str, ParamValue],
) -> str:
    """Hex SHA-256 naming one cacheable result (see the module invariants). `scope` from `cache_scope`."""
    _check_scope(scope)
    enc = _Encoder(_CACHE_KEY_TAG)
    for field in (scope, model, version, model_digest):
        enc.text(field)
    _encode_inputs(enc, inputs)
    _encode_outputs(enc, outputs)
    _encode_parameters(enc, parameters, OUTPUT_AFFECTING_EXCLUDED)
    return enc.hexdigest()


def request_fingerprint(
    *,
    model: str,
    requested_version: str,
    inputs: Sequence[TensorBytes],
    outputs: Sequence[str],
    parameters: Mapping[str, ParamValue],
) -> str:
    """Hex SHA-256 of a request *as sent*, for idempotency: the version as requested (possibly ""), not the
    resolved one, so a retry after a rollout is still "the same request"; parameters other than
    `FINGERPRINT_EXCLUDED`. The tenant is not included: records are already stored under a tenant-scoped
    key. The client's request `id` is not included either (a correlation label, not part of the request)."""
    enc = _Encoder(_FINGERPRINT_TAG)
    enc.text(model)
    enc.text(requested_version)
    _encode_inputs(enc, inputs)
    _encode_outputs(enc, outputs)
    _encode_parameters(enc, parameters, FINGERPRINT_EXCLUDED)
    return enc.hexdigest()
