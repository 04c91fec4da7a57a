"""The in-process router fixture runs its routers as a router process would run: beside a frozen heap.

A full collection of the test session's heap (~760,000 objects halfway through the suite) paused an
in-process router for up to 470 ms, which made a latency test's tail (tests/integration/test_head_of_line.py).
`make_router` freezes that heap while its routers run (tests/integration/conftest.py)."""

from __future__ import annotations

import gc

import pytest

from tests.integration.conftest import MakeRouter

pytestmark = pytest.mark.integration


async def test_a_running_router_leaves_the_sessions_heap_to_the_collector_unscanned(
    make_router: MakeRouter,
) -> None:
    await make_router()
    frozen = gc.get_freeze_count()
    scanned = sum(len(gc.get_objects(generation)) for generation in range(3))
    assert frozen > 0
    assert scanned < frozen, (scanned, frozen)
