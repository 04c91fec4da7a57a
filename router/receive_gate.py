"""The receive gate: how many request bodies one tenant may have arriving at once on the client port.

A body is charged to the in-flight byte budget (router/policy/budget.py) only once gRPC has received all
of it; until then gRPC holds what has arrived, up to `router.max_message_bytes` per call. In grpc.aio
1.85 a unary handler runs only once its call's message is in, while a request-streaming handler reads
nothing until it asks for a message. So this gate puts each tenant call behind a request-streaming
handler that takes a slot before asking gRPC for the body:

- `ModelInfer`: at most `router.tenant_max_receives` bodies of one tenant arrive at once. A call beyond
  them waits, unread, for up to `RECEIVE_SLOT_WAIT_S` (bursts of small calls pass through in turn), then
  is refused RESOURCE_EXHAUSTED `receives_busy` with a retry hint. A body that has not arrived
  `router.receive_timeout_s` after its call did is refused DEADLINE_EXCEEDED `receive_timeout` (at most
  0.1 s later: one timer keeps every read's deadline, router/read_deadlines.py), which ends the call and
  lets go of what arrived of it;
- `ModelStreamInfer`: at most `router.tenant_max_streams` streams of one tenant are open at once (a
  stream receives one message at a time: its reader stops while it serves `stream_max_inflight`); one
  more is refused RESOURCE_EXHAUSTED `too_many_streams` before anything of it is read.

The router's own queue probe (router/queue_probe.py, marked by its per-process token) passes untouched:
it measures how long calls wait for the router's code, and must not queue behind a tenant's slots.

The gate is also the client port's auth gate (router/auth.py, through common/grpc_gate.py's `refusal`),
and it is no server interceptor: grpc.aio runs an interceptor chain as coroutines of its own for every
call (~5 µs of CPU a call, docs/performance.md). Every handler goes in through `GatedServer` instead:
gRPC asks a generic handler for a method's handler synchronously, with the call's metadata and before
anything of the call is read, so the check runs right there (`_Checked`), and `ModelStreamInfer`'s
handler comes back behind its tenant's stream slots; `ModelInfer`, registered with gRPC (router/edge.py
`QUEUED_APART`), is served by a request-streaming handler that runs the check first, then the door and
the slots.

Invariant: a slot is taken and given back by the handler that holds it, in the same task, however the call
ends; a call the auth check refuses is refused before anything of it is read and never reaches a slot. The
tenant is named by the same API key the data plane authenticates; a key that no longer authenticates goes
on to the handler, which refuses it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeAlias

import grpc

from sluice_inference.common.clock import Clock
from sluice_inference.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    SluiceError,
    Unauthenticated,
)
from sluice_inference.common.grpc_errors import abort
from sluice_inference.common.grpc_gate import CallCheck, is_open, refusal
from sluice_inference.router.auth import TenantKeys
from sluice_inference.router.edge import PASSED_DOOR, PROBE_KEY, FrontDoor
from sluice_inference.router.kserve_codec import CallHead, read_head
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.tenants import Tenant
from sluice_inference.router.read_deadlines import ReadDeadlines

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
    """Counters per tenant against one cap; a tenant's entry lives while it holds a slot or has waiters.

    Waiters queue first come, first served, and a slot given back is handed to the oldest waiter
    directly: waking every waiter on each give-back (an Event per tenant, as first written) made an
    overloaded router spend its core waking hundreds of calls that went back to sleep, and goodput fell to
    nothing at 3x its rate."""

    def __init__(self, cap: int, clock: Clock) -> None:
        self.cap = cap
        self._clock = clock
        self.held: dict[str, int] = {}
        self._waiters: dict[str, collections.deque[asyncio.Future[bool]]] = {}

    def try_take(self, tenant: str) -> bool:
        """Take a slot now if one is free and nobody is queued for one."""
        held = self.held.get(tenant, 0)
        if held >= self.cap or tenant in self._waiters:
            return False
        self.held[tenant] = held + 1
        return True

    async def take(self, tenant: str, within_s: float) -> bool:
        """Take a slot, waiting in line up to `within_s` for one to be handed over."""
        if self.try_take(tenant):
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(tenant, collections.deque()).append(waiter)
        timer = self._clock.call_at(self._clock.now() + within_s, lambda: _give_up(waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.give_back(tenant)  # handed a slot in the same step the call was cancelled
            raise
        finally:
            timer.cancel()
            self._forget_gone(tenant)

    def give_back(self, tenant: str) -> None:
        """Return a slot taken by `try_take` or `take`: to the oldest waiter still waiting, if any."""
        queue = self._waiters.get(tenant)
        while queue:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(True)  # the slot changes hands: the count stays
                self._forget_gone(tenant)
                return
        self._waiters.pop(tenant, None)
        left = self.held[tenant] - 1
        if left:
            self.held[tenant] = left
        else:
            del self.held[tenant]

    def _forget_gone(self, tenant: str) -> None:
        """Drop waiters that gave up from the front of the line, and the line once it is empty."""
        queue = self._waiters.get(tenant)
        while queue and queue[0].done():
            queue.popleft()
        if queue is not None and not queue:
            del self._waiters[tenant]


def _give_up(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class ReceiveGate:
    """Refuses the calls `check` refuses before anything of them is read, and serves `ModelInfer` and
    `ModelStreamInfer` behind their tenant's receive and stream slots (module docstring)."""

    def __init__(
        self,
        keys: TenantKeys,
        metrics: RouterMetrics,
        *,
        check: CallCheck,
        probe_token: str,
        max_receives: int,
        max_streams: int,
        receive_timeout_s: float,
        clock: Clock,
    ) -> None:
        self._keys = keys
        self._check = check
        self._clock = clock
        self._metrics = metrics
        self._probe = (PROBE_KEY, probe_token)
        self.receives = TenantSlots(max_receives, clock)
        self.streams = TenantSlots(max_streams, clock)
        self.reads = ReadDeadlines(clock)
        """The receive timeout of each `ModelInfer` body being read."""
        self._timeout_s = receive_timeout_s
        self.door: FrontDoor | None = None
        """The front door, asked before a `ModelInfer` body is read (set once the door exists)."""

    def checked(self, method: str, metadata: Any, handler: Handler) -> Handler:
        """`handler` (`ModelStreamInfer`'s behind its tenant's stream slots), or a refusal that reads
        nothing when `check` refuses the call."""
        refused = self._refused(method, metadata)
        if refused is not None:
            return refusal(handler, refused)
        if method == STREAM and handler.stream_stream is not None:
            return self._within_share(handler)
        return handler

    def _refused(self, method: str, metadata: Any) -> Unauthenticated | PermissionDenied | None:
        """Why `check` refuses the call, or None when it may go on."""
        try:
            self._check(method, metadata)
        except (Unauthenticated, PermissionDenied) as err:
            return err
        return None

    def registered(self, method: str, handler: Handler) -> Handler:
        """The handler gRPC serves a registered method with: `ModelInfer` behind the check, the door and
        its slots, the always-open services as they are. gRPC reads a registered unary method's request
        before any code of ours runs, so any other method is refused here."""
        if method == INFER and handler.unary_unary is not None:
            return self._gated_unary(handler)
        if is_open(method):
            return handler
        raise ValueError(f"{method}: only ModelInfer is registered behind the receive gate")

    def _tenant(self, head: CallHead) -> Tenant | None:
        """The tenant the call's key names (None: it names none), through the keys the gate, the door and
        the data plane share."""
        try:
            return self._keys.authenticate(head.api_key)
        except SluiceError:
            return None

    async def _refuse(self, context: Any, tenant: str, err: SluiceError) -> None:
        """End the call with `err`, counted with the data plane's refusals (`sluice_router_rejections`)."""
        self._metrics.rejected(err, tenant, None)
        await abort(context, err)

    async def _checked_call(self, context: Any, method: str) -> Any:
        """The call's metadata, once `check` let it through (else the call ends with the refusal)."""
        metadata = context.invocation_metadata() or ()
        refused = self._refused(method, metadata)
        if refused is not None:
            await abort(context, refused)
        return metadata

    def _gated_unary(self, handler: Handler) -> Handler:
        """`ModelInfer` behind the check, the door and its tenant's receive slots: one handler for every
        call, which reads the call's tenant from its metadata."""
        serve = handler.unary_unary
        assert serve is not None

        async def receive_then_serve(_requests: AsyncIterator[Any], context: Any) -> Any:
            arrived = self._clock.now()
            metadata = await self._checked_call(context, INFER)
            if self._probe in metadata:  # the router's own queue probe: an empty body, answered at once
                return await serve(await context.read(), context)
            head = read_head(metadata)
            known = self._tenant(head)
            door = self.door
            if door is not None and not door.admits(door.level_of(known)):
                await door.turn_away(context)
            tenant = UNKNOWN_TENANT if known is None else known.name
            if not await self.receives.take(tenant, min(RECEIVE_SLOT_WAIT_S, self._timeout_s)):
                await self._refuse(context, tenant, _busy(self.receives.cap))
            try:
                request = await _first_message(context, self.reads, arrived + self._timeout_s)
            finally:
                self.receives.give_back(tenant)
            if request is _TIMED_OUT:
                await self._refuse(context, tenant, _slow(self._timeout_s))
            if request is grpc.aio.EOF:
                await abort(context, InvalidArgument("the call carried no request", reason="no_request"))
            passed = PASSED_DOOR.set(head)
            try:
                return await serve(request, context)
            finally:
                PASSED_DOOR.reset(passed)

        return grpc.stream_unary_rpc_method_handler(
            receive_then_serve,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _within_share(self, handler: Handler) -> Handler:
        """`ModelStreamInfer` behind its tenant's stream slots (the check has let the call through)."""
        serve: Any = handler.stream_stream  # an async generator function (grpc-stubs type it as sync)
        assert serve is not None

        async def within_share(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            known = self._tenant(read_head(context.invocation_metadata()))
            tenant = UNKNOWN_TENANT if known is None else known.name
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


class _Checked(grpc.GenericRpcHandler):
    """A generic handler whose handlers pass the gate's check first (`ReceiveGate.checked`): gRPC asks it
    synchronously, with the call's metadata, before anything of the call is read."""

    def __init__(self, inner: grpc.GenericRpcHandler, gate: ReceiveGate) -> None:
        self._inner = inner
        self._gate = gate

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        """The method's handler, or a refusal standing in for it; None (UNIMPLEMENTED) when there is none."""
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        details = handler_call_details
        return self._gate.checked(details.method, details.invocation_metadata, handler)


class GatedServer:
    """A grpc.aio server as the router's services are added to it: every handler goes in behind the gate
    (generic handlers through `_Checked`, registered methods through `ReceiveGate.registered`)."""

    def __init__(self, server: grpc.aio.Server, gate: ReceiveGate) -> None:
        self._server = server
        self._gate = gate

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Serve these handlers, each call checked before anything of it is read."""
        self._server.add_generic_rpc_handlers(tuple(_Checked(handler, self._gate) for handler in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        """Register these methods with gRPC, behind the gate."""
        gated = {name: self._gate.registered(f"/{service}/{name}", h) for name, h in handlers.items()}
        self._server.add_registered_method_handlers(service, gated)


_TIMED_OUT = object()
"""Marks a body that did not arrive in time (`grpc.aio.EOF` is gRPC's end of the request stream)."""


async def _first_message(context: Any, reads: ReadDeadlines, deadline: float) -> Any:
    """The call's request (`grpc.aio.EOF` when the client sent none), or `_TIMED_OUT` once `reads` cut it
    at `deadline`. One timer for every read (router/read_deadlines.py), not `asyncio.timeout` (~25 µs of
    CPU a call) nor a timer of its own (~15 µs). Read with `context.read()`, not from the handler's
    request iterator: that one is an async generator, made and registered with the event loop per call,
    around the same read."""
    task = asyncio.current_task()
    assert task is not None
    reads.start(task, deadline)
    try:
        return await context.read()
    except asyncio.CancelledError:
        if reads.was_cut(task) and task.uncancel() == 0:  # only the deadline asked: the call goes on
            return _TIMED_OUT
        raise
    finally:
        reads.end(task)


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
