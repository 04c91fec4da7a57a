"""The receive gate's per-tenant slots (router/receive_gate.py); the gate on a real server is exercised by
tests/integration/test_slow_clients.py."""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace
from typing import Any, cast

import grpc

from sluice_inference.common.clock import FakeClock, MonotonicClock
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.router.auth import TenantKeys
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.tenants import TenantDirectory, hash_api_key
from sluice_inference.router.receive_gate import INFER, ReceiveGate, TenantSlots


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
    """The context of a call whose body arrives at once; it notes the slots held while it is read."""

    def __init__(self, gate: ReceiveGate, metadata: tuple[tuple[str, str], ...], body: str) -> None:
        self._gate, self._metadata, self._body = gate, metadata, body
        self.held_while_read: dict[str, int] = {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def read(self) -> str:
        self.held_while_read = dict(self._gate.receives.held)
        return self._body


async def test_one_gated_handler_serves_every_call_each_with_its_own_tenant() -> None:
    tenants = {name: TenantSettings(api_keys=[hash_api_key(f"{name}-key")]) for name in ("gold", "bronze")}
    directory = TenantDirectory(tenants)
    gate = ReceiveGate(
        TenantKeys(lambda: directory), RouterMetrics(), check=lambda *_: None, probe_token="probe",
        max_receives=4, max_streams=1, receive_timeout_s=5.0, clock=MonotonicClock(),
    )  # fmt: skip

    async def serve(request: str, context: object) -> str:
        return request

    handler: Any = grpc.unary_unary_rpc_method_handler(serve)
    handlers = []

    async def call(tenant: str, *, in_interceptor_context: bool) -> tuple[str, dict[str, int]]:
        metadata = (("authorization", f"Bearer {tenant}-key"),)
        details: Any = SimpleNamespace(method=INFER, invocation_metadata=metadata)
        gated = await gate.intercept_service(lambda _: asyncio.sleep(0, handler), details)
        assert gated is not None and gated.stream_unary is not None
        handlers.append(gated)
        context = _Call(gate, metadata, f"body of {tenant}")
        answer: Any = gated.stream_unary(cast(Any, None), cast(Any, context))
        if not in_interceptor_context:  # gRPC runs both in one task; were it not so, the call is read
            answer = asyncio.create_task(answer, context=contextvars.Context())
        return await answer, context.held_while_read

    assert await call("gold", in_interceptor_context=True) == ("body of gold", {"gold": 1})
    assert await call("bronze", in_interceptor_context=False) == ("body of bronze", {"bronze": 1})
    assert handlers[0] is handlers[1]  # made once
    assert gate.receives.held == {}
