"""The receive gate's per-tenant slots (router/receive_gate.py); the gate on a real server is exercised by
tests/integration/test_slow_clients.py."""

from __future__ import annotations

import asyncio

from sluice_inference.common.clock import FakeClock
from sluice_inference.router.receive_gate import TenantSlots


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
