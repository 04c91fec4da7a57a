"""The receive gate: how many request bodies one tenant may have arriving at once on the client port.

A body is charged to the in-flight byte budget (router/policy/budget.py) only once gRPC has received all
of it; until then gRPC holds what has arrived, up to `router.max_message_bytes` per call. In grpc.aio
1.85 a server interceptor runs once a call's headers are in and before any of its message is requested
(`_handle_rpc` finds the handler, interceptors included, then `_handle_unary_unary_rpc` receives the
message), and a request-streaming handler reads nothing until it iterates its requests. So this gate
puts each tenant call behind a request-streaming handler that takes a slot before asking gRPC for the
body:

- `ModelInfer`: at most `router.tenant_max_receives` bodies of one tenant arrive at once. A call beyond
  them waits, unread, for up to `RECEIVE_SLOT_WAIT_S` (bursts of small calls pass through in turn), then
  is refused RESOURCE_EXHAUSTED `receives_busy` with a retry hint. A body that has not arrived
  `router.receive_timeout_s` after its call did is refused DEADLINE_EXCEEDED `receive_timeout`, which
  ends the call and lets go of what arrived of it;
- `ModelStreamInfer`: at most `router.tenant_max_streams` streams of one tenant are open at once (a
  stream receives one message at a time: its reader stops while it serves `stream_max_inflight`); one
  more is refused RESOURCE_EXHAUSTED `too_many_streams` before anything of it is read.

The router's own queue probe (router/queue_probe.py, marked by its per-process token) passes untouched:
it measures how long calls wait for the router's code, and must not queue behind a tenant's slots.

Invariant: a slot is taken and given back by the handler that holds it, in the same task, however the call
ends; a call the auth gate refuses never reaches a slot. The tenant is named by the same API key the
data plane authenticates; a key that no longer authenticates goes on to the handler, which refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from sluice_inference.common.clock import Clock, wait_until
from sluice_inference.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    SluiceError,
)
from sluice_inference.common.grpc_errors import abort
from sluice_inference.router.auth import TenantKeys
from sluice_inference.router.edge import PROBE_KEY
from sluice_inference.router.kserve_codec import api_key
from sluice_inference.router.metrics import RouterMetrics

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
RECEIVE_SLOT_WAIT_S = 1.0
"""How long a `ModelInfer` call waits, unread, for one of its tenant's receive slots. Short, because a
waiting call still holds what HTTP/2 flow control let its client send before the router asked for it."""
RETRY_AFTER_S = 1.0
"""Hint for a refused call: slots free up as bodies arrive or time out."""
UNKNOWN_TENANT = ""
"""Calls whose key does not authenticate share one set of slots; their handler refuses them anyway."""


class TenantSlots:
    """Counters per tenant against one cap; a tenant's entry lives while it holds a slot."""

    def __init__(self, cap: int, clock: Clock) -> None:
        self.cap = cap
        self._clock = clock
        self.held: dict[str, int] = {}
        self._freed: dict[str, asyncio.Event] = {}

    def try_take(self, tenant: str) -> bool:
        """Take a slot now if one is free."""
        if self.held.get(tenant, 0) >= self.cap:
            return False
        self.held[tenant] = self.held.get(tenant, 0) + 1
        return True

    async def take(self, tenant: str, within_s: float) -> bool:
        """Take a slot, waiting up to `within_s` for one to be given back."""
        until = self._clock.now() + within_s
        while not self.try_take(tenant):
            if self._clock.now() >= until:
                return False
            freed = asyncio.ensure_future(self._freed.setdefault(tenant, asyncio.Event()).wait())
            if not await wait_until(self._clock, {freed}, until):
                freed.cancel()
        return True

    def give_back(self, tenant: str) -> None:
        """Return a slot taken by `try_take` or `take`, and wake the tenant's waiters."""
        left = self.held[tenant] - 1
        if left:
            self.held[tenant] = left
        else:
            del self.held[tenant]
        freed = self._freed.pop(tenant, None)
        if freed is not None:
            freed.set()


class ReceiveGate(grpc.aio.ServerInterceptor):
    """Puts `ModelInfer` and `ModelStreamInfer` behind their tenant's receive and stream slots."""

    def __init__(
        self,
        keys: TenantKeys,
        metrics: RouterMetrics,
        *,
        probe_token: str,
        max_receives: int,
        max_streams: int,
        receive_timeout_s: float,
        clock: Clock,
    ) -> None:
        self._keys = keys
        self._clock = clock
        self._metrics = metrics
        self._probe = (PROBE_KEY, probe_token)
        self.receives = TenantSlots(max_receives, clock)
        self.streams = TenantSlots(max_streams, clock)
        self._timeout_s = receive_timeout_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """Wrap the two tenant inference methods; pass everything else through."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if self._probe in (handler_call_details.invocation_metadata or ()):
            return handler  # the router's own queue probe: an empty body, answered before it is parsed
        if method == INFER and handler.unary_unary is not None:
            return self._gated_unary(handler, self._tenant(handler_call_details.invocation_metadata))
        if method == STREAM and handler.stream_stream is not None:
            return self._gated_stream(handler, self._tenant(handler_call_details.invocation_metadata))
        return handler

    def _tenant(self, metadata: Any) -> str:
        """The tenant the call's key names (the metadata the interceptor already has: cheaper than the
        context's copy), through the keys the gate, the door and the data plane share."""
        try:
            return self._keys.authenticate(api_key(metadata)).name
        except SluiceError:
            return UNKNOWN_TENANT

    async def _refuse(self, context: Any, tenant: str, err: SluiceError) -> None:
        """End the call with `err`, counted with the data plane's refusals (`sluice_router_rejections`)."""
        self._metrics.rejected(err, tenant, None)
        await abort(context, err)

    def _gated_unary(self, handler: Handler, tenant: str) -> Handler:
        serve = handler.unary_unary
        assert serve is not None

        async def receive_then_serve(requests: AsyncIterator[Any], context: Any) -> Any:
            arrived = self._clock.now()
            if not await self.receives.take(tenant, min(RECEIVE_SLOT_WAIT_S, self._timeout_s)):
                await self._refuse(context, tenant, _busy(self.receives.cap))
            try:
                request = await _first_message(requests, self._clock, arrived + self._timeout_s)
            finally:
                self.receives.give_back(tenant)
            if request is _TIMED_OUT:
                await self._refuse(context, tenant, _slow(self._timeout_s))
            if request is None:
                await abort(context, InvalidArgument("the call carried no request", reason="no_request"))
            return await serve(request, context)

        return grpc.stream_unary_rpc_method_handler(
            receive_then_serve,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _gated_stream(self, handler: Handler, tenant: str) -> Handler:
        serve: Any = handler.stream_stream  # an async generator function (grpc-stubs type it as sync)
        assert serve is not None

        async def within_share(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            if not self.streams.try_take(tenant):
                await self._refuse(context, tenant, _too_many_streams(self.streams.cap))
            try:
                answers = serve(requests, context)
                async with contextlib.aclosing(answers):
                    async for answer in answers:
                        yield answer
            finally:
                self.streams.give_back(tenant)

        return grpc.stream_stream_rpc_method_handler(
            within_share,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


_TIMED_OUT = object()
"""Marks a body that did not arrive in time (None is gRPC's end of the request stream)."""


async def _first_message(requests: AsyncIterator[Any], clock: Clock, deadline: float) -> Any:
    """The call's request (None when the client sent none), or `_TIMED_OUT` once `clock` reaches `deadline`.
    A bare timer that cancels this task, rather than `asyncio.timeout`: it runs for every call, and costs
    about half as much (measured ~25 µs of CPU per call for `asyncio.timeout`)."""
    task = asyncio.current_task()
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = clock.call_at(deadline, expire)
    try:
        return await anext(requests, None)
    except asyncio.CancelledError:
        if expired and task.uncancel() == 0:  # only this timer asked: the call itself goes on
            return _TIMED_OUT
        raise
    finally:
        timer.cancel()


def _busy(cap: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"this tenant already has {cap} request bodies arriving (router.tenant_max_receives): retry after "
        "the hint",
        reason="receives_busy",
        retry_after_s=RETRY_AFTER_S,
    )


def _too_many_streams(cap: int) -> ResourceExhausted:
    return ResourceExhausted(
        f"this tenant already has {cap} ModelStreamInfer streams open (router.tenant_max_streams): retry "
        "after the hint, or send more on an open stream",
        reason="too_many_streams",
        retry_after_s=RETRY_AFTER_S,
    )


def _slow(timeout_s: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"the request body did not arrive within {timeout_s:g} s (router.receive_timeout_s)",
        reason="receive_timeout",
    )
