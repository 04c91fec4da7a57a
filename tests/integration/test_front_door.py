"""The front door on a real router that is really overloaded: a callback holds its event loop 30 ms of
every 40 (what a saturated CPU does to it) while waves of 200 calls arrive, so calls pile up in gRPC's queue
before the router's code. Part of the new requests are then refused UNAVAILABLE `router_overloaded` with a
retry hint, the admitted ones are served, and once calls reach the router promptly again everything is
admitted. With two tenants in every wave, the door refuses the low-priority one first: gold keeps its
requests while bronze absorbs the refusals.

The regime is router-bound by construction: the held loop, not the machine's speed, makes the overload,
and the waves are sent until the door has refused enough, so a slower core only gets there sooner."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc
import pytest

from sluice_inference.common.grpc_errors import PUSHBACK_KEY, REASON_KEY
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import RouterSettings, TenantSettings
from sluice_inference.router.main import RouterServer
from sluice_inference.router.policy.door import RETRY_AFTER_S
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter, Spawn
from tests.integration.test_hostile_clients import synthetic_request
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

HOLD_S, EVERY_S = 0.030, 0.040
WAVE, WAVES, REFUSALS = 200, 30, 20
"""Waves of concurrent calls, far more than a router whose loop runs a quarter of the time takes in
promptly, until the door has refused `REFUSALS` (at most `WAVES` waves)."""


@pytest.fixture
async def served(make_router: MakeRouter, spawn: Spawn) -> AsyncIterator[RouterServer]:
    settings = RouterSettings(listen="127.0.0.1:0", metrics_port=0, door_max_delay_ms=10, door_sustain_s=0.2)
    router = await make_router(router=settings)
    spawn("w1")
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    yield router


@contextmanager
def hogged_loop() -> Iterator[None]:
    """Hold the running loop `HOLD_S` of every `EVERY_S` (what a saturated CPU does to it)."""
    loop = asyncio.get_running_loop()
    handle: asyncio.Handle

    def hog() -> None:
        nonlocal handle
        time.sleep(HOLD_S)
        handle = loop.call_later(EVERY_S - HOLD_S, hog)

    handle = loop.call_soon(hog)
    try:
        yield
    finally:
        handle.cancel()


async def outcomes(port: int, count: int, key: str | None = None) -> list[tuple[grpc.StatusCode, str, str]]:
    """(code, sluice-reason, retry pushback) of `count` concurrent ModelInfer calls (with `key`, if any)."""
    metadata = None if key is None else (("authorization", f"Bearer {key}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)

        async def one() -> tuple[grpc.StatusCode, str, str]:
            try:
                await stub.ModelInfer(synthetic_request(), timeout=10, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                trailers = dict(err.trailing_metadata() or ())
                return err.code(), str(trailers.get(REASON_KEY, "")), str(trailers.get(PUSHBACK_KEY, ""))
            return grpc.StatusCode.OK, "", ""

        return list(await asyncio.gather(*(one() for _ in range(count))))


async def test_an_overloaded_router_refuses_part_of_the_requests_with_a_hint_and_recovers(
    served: RouterServer,
) -> None:
    during: list[tuple[grpc.StatusCode, str, str]] = []
    with hogged_loop():
        for _ in range(WAVES):  # calls pile up before the router's code until the door notices
            during += await outcomes(served.port, WAVE)
            if served.door.refused >= REFUSALS:
                break
    refused = [o for o in during if o[0] != grpc.StatusCode.OK]
    overloaded = (grpc.StatusCode.UNAVAILABLE, "router_overloaded", str(round(RETRY_AFTER_S * 1000)))
    assert len(refused) >= REFUSALS and all(o == overloaded for o in refused), during
    assert len(refused) < len(during)  # it admits a share, and serves it
    await eventually(lambda: served.door.fraction == 1.0, 10, "the door to open again")
    assert await outcomes(served.port, 20) == [(grpc.StatusCode.OK, "", "")] * 20


def unlimited(key: str, priority: int) -> TenantSettings:
    """A tenant whose quotas never refuse: only the door does."""
    return TenantSettings(
        api_keys=[hash_api_key(key)], default_priority=priority, rate=1e6, burst=10**6, max_inflight=10**6
    )


TWO_TENANTS = {"gold": unlimited("gold-key", 1), "bronze": unlimited("bronze-key", 3)}
GOLD_WAVE, BRONZE_WAVE = 40, 160


async def test_an_overloaded_router_refuses_bronze_before_gold(make_router: MakeRouter, spawn: Spawn) -> None:
    settings = RouterSettings(listen="127.0.0.1:0", metrics_port=0, door_max_delay_ms=10, door_sustain_s=0.2)
    router = await make_router(router=settings, tenants=TWO_TENANTS)
    spawn("w1")
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    gold: list[tuple[grpc.StatusCode, str, str]] = []
    bronze: list[tuple[grpc.StatusCode, str, str]] = []
    with hogged_loop():
        for _ in range(WAVES):  # each wave a fifth gold, the rest bronze, all at once
            golds, bronzes = await asyncio.gather(
                outcomes(router.port, GOLD_WAVE, "gold-key"), outcomes(router.port, BRONZE_WAVE, "bronze-key")
            )
            gold, bronze = gold + golds, bronze + bronzes
            if router.door.refused >= 5 * REFUSALS:
                break
    overloaded = (grpc.StatusCode.UNAVAILABLE, "router_overloaded", str(round(RETRY_AFTER_S * 1000)))
    refused = {
        name: sum(o == overloaded for o in got) / len(got)
        for name, got in (("gold", gold), ("bronze", bronze))
    }
    assert all(o[0] in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE) for o in gold + bronze)
    assert refused["bronze"] > 0.1, refused  # the door did close
    assert refused["gold"] < refused["bronze"] / 2, refused
