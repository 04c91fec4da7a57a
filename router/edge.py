"""The router's wire edge: how request bodies become messages, and what happens when they cannot.

gRPC's generated registration parses a body with `FromString` inside grpc itself: a body that does not
parse ends the call with UNKNOWN and an ERROR log line with a traceback, per body — a cheap way for anyone
to flood the logs. Here every method of a service is registered from its descriptor with a deserializer
that never raises: a body that does not parse becomes `Malformed`, which unary methods answer with
INVALID_ARGUMENT (through the one error boundary) and `ModelStreamInfer` answers in-band; the count is
logged at most once per `MALFORMED_LOG_INTERVAL_S`.

The front door (router/policy/door.py) stands before the parse: a method served through it receives the
raw body, and while calls wait too long to reach the router's code part of them are refused UNAVAILABLE
with a retry hint before a byte of them is parsed, so a refusal costs a fraction of serving. Which part
goes by the caller's tenant: the door reads the call's metadata once (`read_head`), ranks the call at its
tenant's priority level (the API key's tenant, remembered by `TenantKeys`, so no key is hashed again),
and hands the head and the body's size on to the servicer, which reads neither again.

Invariant: no servicer method ever sees a body it has to re-check for parse errors except as `Malformed`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from sluice_inference.common.clock import Clock
from sluice_inference.common.errors import InvalidArgument, SluiceError, Unavailable
from sluice_inference.common.grpc_errors import abort, grpc_code, trailers_for
from sluice_inference.common.logs import LogThrottle
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.router.auth import TenantKeys
from sluice_inference.router.kserve_codec import CallHead, read_head
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.door import RETRY_AFTER_S, Door
from sluice_inference.router.policy.tenants import Tenant

log = logging.getLogger(__name__)

MALFORMED_LOG_INTERVAL_S = 10.0
DOORED_METHODS = {"ModelInfer": "infer_from_head"}
"""Methods whose calls pass the front door before their body is parsed, and the servicer method that
serves them past it: `(request, context, head: CallHead, body_bytes: int)`."""
QUEUED_APART = frozenset({"ModelInfer"})
"""Methods registered with gRPC, each queued in core apart from the others: client inference calls. The
router's queue probe (router/queue_probe.py) measures the wait in `ModelInfer`'s own queue. Not
`ModelStreamInfer`: a stream is one call for many requests, and each registered method costs every
call gRPC takes (`GenericOnly`)."""
OVERLOADED = Unavailable(
    "the router is overloaded (calls wait too long to reach it): retry after the hint, or on another router",
    reason="router_overloaded",
    retry_after_s=RETRY_AFTER_S,
)
PROBE_KEY = "sluice-probe"
"""Metadata that marks the router's own queue probe (router/queue_probe.py), with its per-process token."""
PROBE_ANSWER = kserve.ModelInferResponse()
_OVERLOADED_CODE = grpc_code(OVERLOADED.code)
_OVERLOADED_TRAILERS = trailers_for(OVERLOADED)
"""Built once: a refusal must cost as little as possible."""


@dataclass(frozen=True)
class Malformed:
    """A request body that is not a valid message of the method's request type."""

    size: int
    why: str

    def error(self) -> InvalidArgument:
        """What the caller is told."""
        return InvalidArgument(
            f"the request body ({self.size} bytes) is not a valid protobuf message: {self.why}",
            reason="malformed_body",
        )


class MalformedBodies:
    """Counts malformed bodies and logs them at most once per interval, whatever their rate."""

    def __init__(self, clock: Clock) -> None:
        self._log = LogThrottle(log, MALFORMED_LOG_INTERVAL_S, clock)

    def seen(self, method: str, body: Malformed) -> None:
        """Note one malformed body."""
        self._log.warning("malformed request bodies (latest: %s, %d bytes)", method, body.size)


def _deserializer(message_class: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(raw: bytes) -> Message | Malformed:
        try:
            return message_class.FromString(raw)
        except DecodeError as exc:
            return Malformed(len(raw), str(exc)[:200])

    return parse


PASSED_DOOR: ContextVar[CallHead | None] = ContextVar("sluice_passed_door", default=None)
"""The call's head once the receive gate (router/receive_gate.py) has let it through the door, so the
doored handler it calls in the same task does not ask the door again."""


def _unary(
    behavior: Callable[[Any, Any], Any], method: str, bodies: MalformedBodies
) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Malformed):
            bodies.seen(method, request)
            await abort(context, request.error())
        return await behavior(request, context)

    return guarded


def _doored(
    behavior: Callable[[Any, Any, CallHead, int], Any],
    parse: Callable[[bytes], Message | Malformed],
    method: str,
    bodies: MalformedBodies,
    door: FrontDoor,
) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Any]:
    async def guarded(body: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        head = PASSED_DOOR.get()
        if head is None:
            metadata = context.invocation_metadata() or ()
            if (PROBE_KEY, door.probe_token) in metadata:
                return PROBE_ANSWER  # the router's own probe: it measured the wait, nothing to serve
            head = await door.enter(metadata, context)
        request = parse(body)
        if isinstance(request, Malformed):
            bodies.seen(method, request)
            await abort(context, request.error())
        return await behavior(request, context, head, len(body))

    return guarded


@dataclass(frozen=True)
class FrontDoor:
    """The door, where its refusals are counted, the token that marks the router's own probe, whom to
    tell that a client call came in (the probe measures only while calls come), and how a call's tenant
    and priority level are known before its body is parsed."""

    door: Door
    metrics: RouterMetrics
    probe_token: str
    arrived: Callable[[], None]
    keys: TenantKeys
    levels: int
    """The configured priority levels: the door's rank of a call is one of 1..levels."""

    def level(self, head: CallHead) -> int:
        """The priority level the door ranks a call at: its tenant's default priority; the lowest for a
        key that does not authenticate (the client port's gate refuses those first; without it the data
        plane refuses them, with the reason, if the door lets them in)."""
        try:
            tenant = self.keys.authenticate(head.api_key)
        except SluiceError:
            return self.levels
        return self.level_of(tenant)

    def level_of(self, tenant: Tenant | None) -> int:
        """`level` for a caller already authenticated (None: its key did not authenticate)."""
        return self.levels if tenant is None else min(self.levels, tenant.settings.default_priority)

    def refused(self, level: int) -> None:
        """Count one refusal at `level`."""
        self.metrics.door_refusals(self.metrics.priority_label(level)).inc()

    def admits(self, level: int) -> bool:
        """Whether a client call ranked at `level` passes the door now (a refusal is counted)."""
        self.arrived()
        if self.door.admit(level):
            return True
        self.refused(level)
        return False

    @staticmethod
    async def turn_away(context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
        """End a call the door refused: UNAVAILABLE `router_overloaded`, with the retry hint."""
        await context.abort(_OVERLOADED_CODE, OVERLOADED.message, trailing_metadata=_OVERLOADED_TRAILERS)

    async def enter(self, metadata: Any, context: grpc.aio.ServicerContext[Any, Any]) -> CallHead:
        """Admit a client call through the door, or end it UNAVAILABLE `router_overloaded`: all it needs
        is the call's metadata, so a refusal costs no body and no parse. (The client port's receive gate
        asks `admits` itself, with the tenant it has authenticated, before it reads the body.)"""
        head = read_head(metadata)
        if not self.admits(self.level(head)):
            await self.turn_away(context)
        return head


def _handler(
    method: MethodDescriptor, servicer: object, bodies: MalformedBodies, door: FrontDoor | None
) -> grpc.RpcMethodHandler[Any, Any]:
    behavior = getattr(servicer, method.name)
    parse = _deserializer(GetMessageClass(method.input_type))
    serialize = GetMessageClass(method.output_type).SerializeToString
    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(
            behavior, request_deserializer=parse, response_serializer=serialize
        )
    if method.client_streaming or method.server_streaming:
        raise ValueError(f"{method.full_name}: only unary and bidirectional methods are served")
    if door is not None and method.name in DOORED_METHODS:
        past_door = getattr(servicer, DOORED_METHODS[method.name])
        guarded = _doored(past_door, parse, method.full_name, bodies, door)
        return grpc.unary_unary_rpc_method_handler(guarded, response_serializer=serialize)
    return grpc.unary_unary_rpc_method_handler(
        _unary(behavior, method.full_name, bodies), request_deserializer=parse, response_serializer=serialize
    )


class Services(Protocol):
    """Where a service's handlers are added: a grpc.aio server, or the router's gate in front of one
    (router/receive_gate.py `GatedServer`)."""

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Serve these handlers."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Register these methods of `service` with gRPC (a queue of their own in its core)."""


def add_service(
    server: Services,
    service: ServiceDescriptor,
    servicer: object,
    bodies: MalformedBodies,
    door: FrontDoor | None = None,
) -> None:
    """Serve every method of `service` from `servicer` with non-raising deserializers; the methods in
    `DOORED_METHODS` behind `door`, if given. Only the methods in `QUEUED_APART` are registered with
    gRPC; the rest are served through a generic handler (`GenericOnly` says why)."""
    handlers = {method.name: _handler(method, servicer, bodies, door) for method in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    apart = {name: handler for name, handler in handlers.items() if name in QUEUED_APART}
    if apart:
        server.add_registered_method_handlers(service.full_name, apart)


class GenericOnly:
    """A server as generated `add_*Servicer_to_server` functions see it, serving their methods through the
    generic handler only. grpc.aio 1.85 keeps one pending request-call future per registered method and
    waits on all of them (`asyncio.wait`: a callback added to and removed from each) for every call it
    takes: the router's 16 registered methods cost ~15 µs of CPU per call (a bare grpc.aio call costs
    ~0.40 ms; micro-measured, bare server with and without 16 registered methods). A registered method
    also has a queue of its own in gRPC core: so `ModelInfer` (`QUEUED_APART`) stays registered, and
    probes, metadata and admin calls do not wait behind an inference backlog (nor it behind them)."""

    def __init__(self, server: Services) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Serve these handlers."""
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Ignored: the generated code registers the methods it has just added as generic handlers."""
