"""The one error hierarchy: every failure a caller can see, with its status code and retry semantics.

Domain code raises (or returns) these; exactly one place, `sluice_inference.common.grpc_errors`, turns them
into a gRPC status with `RetryInfo` and the `grpc-retry-pushback-ms` trailer. This module imports no grpc, so
the policy core can use it. Codes are google.rpc.Code values (the same numbers gRPC uses).
"""

from __future__ import annotations

import enum

MAX_MESSAGE_CHARS = 4096
"""The longest message an error keeps. A message names the limit that was hit and never needs more; one
that repeats a caller's input (a name, a value) is cut here, so no answer, trailer, log line or stored
outcome carries a hostile caller's input back at its length, whichever code path built the message."""


class Code(enum.IntEnum):
    """google.rpc.Code, so the policy core can name statuses without importing grpc."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class SluiceError(Exception):
    """A failure with a status code, a machine-readable reason, and (when retryable) a retry hint.

    `reason` is a short snake_case label used in metrics (`queue_full`, `no_worker`, ...); the message is
    for humans and names the limit that was hit.
    """

    code: Code = Code.UNKNOWN
    retryable: bool = False

    def __init__(self, message: str, *, reason: str = "", retry_after_s: float | None = None) -> None:
        if (cut := len(message) - MAX_MESSAGE_CHARS) > 0:
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut:,} more characters)"
        super().__init__(message)
        self.message = message
        self.reason = reason or self.code.name.lower()
        self.retry_after_s = retry_after_s if self.retryable else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.message!r}, reason={self.reason!r})"


class InvalidArgument(SluiceError):
    """Malformed request: wrong dtype, shape or size, an impossible deadline. Never retry."""

    code = Code.INVALID_ARGUMENT


class NotFound(SluiceError):
    """Unknown model or version."""

    code = Code.NOT_FOUND


class Unauthenticated(SluiceError):
    """Missing or unknown API key."""

    code = Code.UNAUTHENTICATED


class PermissionDenied(SluiceError):
    """The tenant may not use this model."""

    code = Code.PERMISSION_DENIED


class FailedPrecondition(SluiceError):
    """An idempotency key reused with a different request."""

    code = Code.FAILED_PRECONDITION


class ResourceExhausted(SluiceError):
    """A rate limit or in-flight quota was hit; retry after the hint."""

    code = Code.RESOURCE_EXHAUSTED
    retryable = True


class Unavailable(SluiceError):
    """Shed, queue full, no ready worker, worker lost: retry after the hint."""

    code = Code.UNAVAILABLE
    retryable = True


class DeadlineExceeded(SluiceError):
    """The deadline passed while queued or executing."""

    code = Code.DEADLINE_EXCEEDED


class Cancelled(SluiceError):
    """The client cancelled; no work is spent on the request."""

    code = Code.CANCELLED


class Internal(SluiceError):
    """The model raised (for this item only) or a bug; not retryable."""

    code = Code.INTERNAL


_BY_CODE: dict[Code, type[SluiceError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Unauthenticated,
        PermissionDenied,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def error_for_code(
    code: int, message: str, *, reason: str = "", retry_after_s: float | None = None
) -> SluiceError:
    """Rebuild a typed error from a status code that crossed a process boundary (worker → router)."""
    try:
        cls = _BY_CODE[Code(code)]
    except (ValueError, KeyError):
        err = SluiceError(message, reason=reason or "unknown")
        err.code = Code(code) if code in Code._value2member_map_ else Code.UNKNOWN
        return err
    return cls(message, reason=reason, retry_after_s=retry_after_s)
