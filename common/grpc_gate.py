"""Refusing a call before its request is read: the one mechanism behind the router's and the worker's
auth gates (the router's receive gate, router/receive_gate.py; the worker's `GateInterceptor`).

A grpc.aio server interceptor, and a generic handler asked for a method's handler, see the method and the
metadata before any request byte is read. To refuse there cheaply we return a *request-streaming*
handler whose behaviour aborts at once and never iterates the request stream, so gRPC reads (and
buffers) nothing of the body. Measured: a unary
handler that aborts still reads the whole message first (16 key-less 60 MB bodies took a router from
40 MB to 1.4 GB RSS), and raising inside the interceptor answers UNKNOWN. The abort goes through
`sluice_inference.common.grpc_errors.abort`, so the status, message and reason trailer are the same as
anywhere else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from sluice_inference.common.errors import PermissionDenied, SluiceError, Unauthenticated
from sluice_inference.common.grpc_errors import abort

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

OPEN_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
    "/sluice.v1.ClusterIdentity/",
)
"""Services any caller may use: Kubernetes probes and service discovery carry no credentials, and the
identity challenge (common/cluster_auth.py) is how a caller decides whether to send one."""


def is_open(method: str) -> bool:
    """Whether `method` (`/package.Service/Method`) is one of the always-open services."""
    return method.startswith(OPEN_PREFIXES)


def metadata_value(metadata: Any, name: str) -> str | None:
    """The first value of a metadata key as text (None when absent); `metadata` as
    `HandlerCallDetails.invocation_metadata` gives it (pairs or `_Metadatum` objects)."""
    for key, value in metadata or ():
        if key == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return None


def refusal(handler: Handler, err: SluiceError) -> Handler:
    """A handler standing in for `handler` that ends the call with `err` and reads no request."""
    if handler.response_streaming:

        async def refuse_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            await abort(context, err)
            yield  # pragma: no cover - abort raises; the yield makes this a streaming handler

        return grpc.stream_stream_rpc_method_handler(refuse_stream)

    async def refuse(requests: AsyncIterator[Any], context: Any) -> Any:
        await abort(context, err)

    return grpc.stream_unary_rpc_method_handler(refuse)


CallCheck: TypeAlias = Callable[[str, Any], None]
"""`check(method, invocation_metadata)`: returns when the call may proceed, raises Unauthenticated or
PermissionDenied when not."""
PeerCheck: TypeAlias = Callable[[str, Any], None]
"""`check(method, context)`, for what only the call's context knows (the TLS peer's certificate): runs as
the handler starts, before a streamed request is read (a unary request has been read by then)."""


def guarded(handler: Handler, method: str, check: PeerCheck) -> Handler:
    """`handler` with `check(method, context)` first; a refusal ends the call through `abort`."""

    async def refuse_unless_allowed(context: Any) -> None:
        try:
            check(method, context)
        except (Unauthenticated, PermissionDenied) as err:
            await abort(context, err)

    kinds: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def one_one(request: Any, context: Any) -> Any:
            await refuse_unless_allowed(context)
            return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(one_one, **kinds)
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def many_one(requests: Any, context: Any) -> Any:
            await refuse_unless_allowed(context)
            return await stream_unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(many_one, **kinds)
    streaming: Any = handler.unary_stream or handler.stream_stream
    assert streaming is not None

    async def to_many(request: Any, context: Any) -> AsyncIterator[Any]:
        await refuse_unless_allowed(context)
        async for response in streaming(request, context):
            yield response

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.unary_stream
        else grpc.stream_stream_rpc_method_handler
    )
    return make(to_many, **kinds)


class GateInterceptor(grpc.aio.ServerInterceptor):
    """Applies a `CallCheck` to every call: the method's own handler when it passes, else a `refusal`
    (nothing of the request is read); with a `PeerCheck`, the handler that passes is `guarded` by it.
    Methods the server does not have stay UNIMPLEMENTED."""

    def __init__(self, check: CallCheck, peer_check: PeerCheck | None = None) -> None:
        self._check = check
        self._peer_check = peer_check

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """Pass or refuse one call, before its request is read."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        try:
            self._check(handler_call_details.method, handler_call_details.invocation_metadata)
        except (Unauthenticated, PermissionDenied) as err:
            return refusal(handler, err)
        if self._peer_check is None:
            return handler
        return guarded(handler, handler_call_details.method, self._peer_check)
