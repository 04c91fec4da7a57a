"""Idle means idle at the front door: the router's queue probe calls itself only while client calls come in
(or while the door is closing or reopening), never with no traffic, and not at all with the door off; under
calm traffic (calls reach the router promptly) at most every `CALM_EVERY_S`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.router.queue_probe import CALM_EVERY_S, PROBE_EVERY_S
from tests.integration.conftest import MakeRouter
from tests.integration.test_hostile_clients import synthetic_request

pytestmark = pytest.mark.integration

QUIET_S = 1.0
"""Long enough for the old probe to send 20 calls (one per 50 ms)."""


async def one_call(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError):  # no worker: the answer does not matter, the arrival does
            await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(synthetic_request(), timeout=5)


async def test_the_probe_measures_only_while_calls_arrive(make_router: MakeRouter) -> None:
    settings = RouterSettings(listen="127.0.0.1:0", metrics_port=0, door_max_delay_ms=250)
    router = await make_router(router=settings)
    await asyncio.sleep(QUIET_S)
    assert router.queue_probe.probes == 0
    await one_call(router.port)
    for _ in range(50):
        if router.queue_probe.probes:
            break
        await asyncio.sleep(0.02)
    assert router.queue_probe.probes == 1  # one call, one probe: it measured the queue that call met
    await asyncio.sleep(QUIET_S)
    assert router.queue_probe.probes == 1  # and nothing after, while no call comes


async def test_with_the_door_off_nothing_is_probed(make_router: MakeRouter) -> None:
    router = await make_router()  # the fixture turns the door off
    await one_call(router.port)
    await asyncio.sleep(0.3)
    assert router.queue_probe.probes == 0


async def test_under_calm_traffic_the_probe_goes_at_the_calm_pace(make_router: MakeRouter) -> None:
    settings = RouterSettings(listen="127.0.0.1:0", metrics_port=0, door_max_delay_ms=250)
    router = await make_router(router=settings)
    loop = asyncio.get_running_loop()
    until = loop.time() + QUIET_S
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        while loop.time() < until:  # calls one after another: each is answered at once (no worker)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.ModelInfer(synthetic_request(), timeout=5)
            await asyncio.sleep(0.01)
    assert not router.door.engaged
    assert 1 <= router.queue_probe.probes <= QUIET_S / CALM_EVERY_S + 1 < QUIET_S / PROBE_EVERY_S / 2
