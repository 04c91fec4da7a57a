"""The one boundary where a SluiceError becomes a gRPC status (docs/design.md §5), and back.

Retryable errors carry both standard hints: a `google.rpc.RetryInfo` detail in `grpc-status-details-bin`
and the `grpc-retry-pushback-ms` trailer that gRPC's own retry policy honours. Terminal errors send
`grpc-retry-pushback-ms: -1` so a gRPC retry policy does not retry them either.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from sluice_inference.common.errors import Code, SluiceError, error_for_code

PUSHBACK_KEY = "grpc-retry-pushback-ms"
DETAILS_KEY = "grpc-status-details-bin"
REASON_KEY = "sluice-reason"


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}
MAX_REMEMBERED_TRAILERS = 1024
"""Distinct refusals whose trailers are remembered (most refusals repeat one message: a tenant over its
rate, a full queue), least recently used first out; a message that varies costs one build, as before."""
MAX_REMEMBERED_MESSAGE_CHARS = 1024
"""Longer messages are built every time, never remembered: the memory the remembered trailers hold stays
bounded (1,024 messages of 1 KiB at most) whatever a message repeats of a caller's input."""


def grpc_code(code: Code) -> grpc.StatusCode:
    """The grpc.StatusCode with the same number (a lookup: asked per error answer, and an enum member's
    `value` is a descriptor call)."""
    return _STATUS_BY_NUMBER.get(int(code), grpc.StatusCode.UNKNOWN)


def trailers_for(err: SluiceError) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata carrying the retry hint, the status details and the machine-readable reason."""
    delay_ms = None
    if err.retryable and err.retry_after_s is not None:
        delay_ms = max(1, round(err.retry_after_s * 1000))
    if len(err.message) > MAX_REMEMBERED_MESSAGE_CHARS:
        return _build_trailers(int(err.code), err.message, err.reason, delay_ms)
    return _remembered_trailers(int(err.code), err.message, err.reason, delay_ms)


def _build_trailers(
    code: int, message: str, reason: str, delay_ms: int | None
) -> tuple[tuple[str, str | bytes], ...]:
    """`trailers_for`'s answer (a status message with a packed detail: ~10 µs to build and serialize)."""
    status = status_pb2.Status(code=code, message=message)
    pushback = "-1"
    if delay_ms is not None:
        pushback = str(delay_ms)
        info = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=delay_ms // 1000, nanos=(delay_ms % 1000) * 1_000_000)
        )
        detail = any_pb2.Any()
        detail.Pack(info)
        status.details.append(detail)
    return (
        (PUSHBACK_KEY, pushback),
        (REASON_KEY, reason),
        (DETAILS_KEY, status.SerializeToString()),
    )


_remembered_trailers = lru_cache(maxsize=MAX_REMEMBERED_TRAILERS)(_build_trailers)
"""`_build_trailers`, once per distinct refusal."""


async def abort(context: grpc.aio.ServicerContext[object, object], err: SluiceError) -> NoReturn:
    """End the RPC with the error's status, message and hints."""
    await context.abort(grpc_code(err.code), err.message, trailing_metadata=trailers_for(err))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def from_rpc_error(exc: grpc.aio.AioRpcError) -> SluiceError:
    """Rebuild the typed error (with its retry hint) from a failed call, for clients and the CLI."""
    trailers = {k: v for k, v in (exc.trailing_metadata() or ())}
    retry_after: float | None = None
    raw = trailers.get(DETAILS_KEY)
    if isinstance(raw, bytes):
        status = status_pb2.Status.FromString(raw)
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                retry_after = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    reason = trailers.get(REASON_KEY, "")
    code = exc.code().value[0] if exc.code() is not None else code_pb2.UNKNOWN
    return error_for_code(
        code, exc.details() or "", reason=str(reason) if reason else "", retry_after_s=retry_after
    )
