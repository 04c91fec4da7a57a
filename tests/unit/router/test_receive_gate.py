"""The receive gate's per-tenant slots (router/receive_gate.py); the gate on a real server is exercised by
tests/integration/test_slow_clients.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from sluice_inference.common.clock import FakeClock, MonotonicClock
from sluice_inference.common.errors import Unauthenticated
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.router.auth import TenantKeys
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.tenants import TenantDirectory, hash_api_key
from sluice_inference.router.receive_gate import INFER, STREAM, GatedServer, ReceiveGate, TenantSlots


def test_each_tenant_has_its_own_cap_and_an_entry_only_while_it_holds_a_slot() -> None:
    slots = TenantSlots(2, FakeClock())
    assert slots.try_take("a") and slots.try_take("a")
    assert not slots.try_take("a")
    assert slots.try_take("b")
    slots.give_back("a")
    assert slots.held == {"a": 1, "b": 1}
    slots.give_back("a")
    slots.give_back("b")
    assert slots.held == {}


async def test_a_waiter_gets_the_slot_given_back_and_gives_up_at_its_limit() -> None:
    clock = FakeClock(10.0)
    slots = TenantSlots(1, clock)
    assert slots.try_take("a")
    waiter = asyncio.create_task(slots.take("a", 5.0))
    await asyncio.sleep(0.01)
    clock.advance(4.9)
    await asyncio.sleep(0)
    assert not waiter.done()
    slots.give_back("a")
    assert await asyncio.wait_for(waiter, 1.0)
    assert slots.held == {"a": 1}
    late = asyncio.create_task(slots.take("a", 0.05))  # nobody gives it back
    await asyncio.sleep(0.01)
    assert not late.done()  # only the injected clock ends the wait
    clock.advance(0.05)
    assert not await asyncio.wait_for(late, 1.0)
    assert slots.held == {"a": 1}


class _Call:
    """The context of a call whose body arrives at once; it notes the slots held while it is read, and
    whether it was read at all."""

    def __init__(self, gate: ReceiveGate, metadata: tuple[tuple[str, str], ...], body: str) -> None:
        self._gate, self._metadata, self._body = gate, metadata, body
        self.held_while_read: dict[str, int] | None = None
        self.aborted: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def read(self) -> str:
        self.held_while_read = dict(self._gate.receives.held)
        return self._body

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        self.aborted = code
        raise _Aborted(code)


class _Aborted(Exception):
    """What grpc.aio's `abort` does to a handler: it ends."""


def _gate(check: Any = lambda *_: None) -> ReceiveGate:
    tenants = {name: TenantSettings(api_keys=[hash_api_key(f"{name}-key")]) for name in ("gold", "bronze")}
    directory = TenantDirectory(tenants)
    return ReceiveGate(
        TenantKeys(lambda: directory), RouterMetrics(), check=check, probe_token="probe",
        max_receives=4, max_streams=1, receive_timeout_s=5.0, clock=MonotonicClock(),
    )  # fmt: skip


async def _echo(request: str, context: object) -> str:
    return request


def _metadata(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {tenant}-key"),)


async def test_one_gated_handler_serves_every_call_each_with_its_own_tenant() -> None:
    gate = _gate()
    gated: Any = gate.registered(INFER, grpc.unary_unary_rpc_method_handler(_echo))
    assert gated.stream_unary is not None  # nothing is read before the handler asks

    async def call(tenant: str) -> tuple[str, dict[str, int] | None]:
        context = _Call(gate, _metadata(tenant), f"body of {tenant}")
        return await gated.stream_unary(None, context), context.held_while_read

    assert await call("gold") == ("body of gold", {"gold": 1})
    assert await call("bronze") == ("body of bronze", {"bronze": 1})
    assert gate.receives.held == {}


async def test_a_refused_call_is_refused_before_anything_of_it_is_read_or_a_slot_taken() -> None:
    def check(method: str, metadata: Any) -> None:
        if ("authorization", "Bearer gold-key") not in tuple(metadata):
            raise Unauthenticated("no key")

    gate = _gate(check)
    gated: Any = gate.registered(INFER, grpc.unary_unary_rpc_method_handler(_echo))
    context = _Call(gate, _metadata("bronze"), "body")
    with pytest.raises(_Aborted):
        await gated.stream_unary(None, context)
    assert context.aborted is grpc.StatusCode.UNAUTHENTICATED and context.held_while_read is None
    assert gate.receives.held == {}
    # A method served through a generic handler: gRPC asks for its handler with the metadata, and the
    # check answers with a handler that refuses without reading (a request-streaming one).
    admin: Any = grpc.method_handlers_generic_handler(
        "sluice.v1.RouterAdmin", {"GetStats": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    served = GatedServer(cast(Any, _Server()), gate)
    served.add_generic_rpc_handlers([admin])
    [checked] = cast(Any, served)._server.generic
    refused = checked.service(SimpleNamespace(method="/sluice.v1.RouterAdmin/GetStats",
                                              invocation_metadata=_metadata("bronze")))  # fmt: skip
    assert refused.stream_unary is not None and refused.unary_unary is None
    passed = checked.service(SimpleNamespace(method="/sluice.v1.RouterAdmin/GetStats",
                                             invocation_metadata=_metadata("gold")))  # fmt: skip
    assert passed.unary_unary is not None
    missing = SimpleNamespace(method="/sluice.v1.RouterAdmin/Nope", invocation_metadata=_metadata("gold"))
    assert checked.service(missing) is None  # UNIMPLEMENTED, as without the gate


def test_only_model_infer_and_open_services_are_registered_behind_the_gate() -> None:
    gate = _gate()
    unary: Any = grpc.unary_unary_rpc_method_handler(_echo)
    assert gate.registered("/grpc.health.v1.Health/Check", unary) is unary
    with pytest.raises(ValueError, match="only ModelInfer"):
        gate.registered("/sluice.v1.RouterAdmin/GetStats", unary)
    with pytest.raises(ValueError, match="only ModelInfer"):
        gate.registered(STREAM, grpc.stream_stream_rpc_method_handler(_answers))


async def _answers(requests: Any, context: object) -> AsyncIterator[str]:
    async for request in requests:
        yield request


async def test_a_stream_through_the_generic_handler_holds_its_tenants_stream_slot() -> None:
    gate = _gate()  # one stream per tenant
    streams: dict[str, Any] = {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(_answers)}
    inference: Any = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", streams)
    served = GatedServer(cast(Any, _Server()), gate)
    served.add_generic_rpc_handlers([inference])
    [checked] = cast(Any, served)._server.generic
    details = SimpleNamespace(method=STREAM, invocation_metadata=_metadata("gold"))
    first, second = checked.service(details), checked.service(details)

    async def requests() -> AsyncIterator[str]:
        yield "one"
        assert gate.streams.held == {"gold": 1}  # held while the stream is open
        with pytest.raises(_Aborted):  # a second stream of the tenant's is refused
            async for _ in second.stream_stream(None, _Call(gate, _metadata("gold"), "")):
                pass
        yield "two"

    stream = first.stream_stream(requests(), _Call(gate, _metadata("gold"), ""))
    assert [answer async for answer in stream] == ["one", "two"]
    assert gate.streams.held == {}


class _Server:
    """Where `GatedServer` adds handlers."""

    def __init__(self) -> None:
        self.generic: list[Any] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)
