"""A caller that pings faster than the server allows is sent GOAWAY after a few strikes, on the router's
client port as on a worker's stream port (common/grpc_server.py); the routers' own 500 ms stream pings
stay below the workers' bound."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice_inference.common.grpc_server import MAX_PING_STRIKES
from sluice_inference.router.worker_link import KEEPALIVE_OPTIONS
from sluice_inference.worker.main import MIN_PING_INTERVAL_MS
from tests.integration.conftest import MakeRouter

pytestmark = pytest.mark.integration

FLOOD = [
    ("grpc.keepalive_time_ms", 20),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
"""A client pinging every 20 ms with nothing else to say: 25 times the router's bound."""


async def test_a_ping_flood_on_an_idle_stream_is_cut_off_with_goaway(make_router: MakeRouter) -> None:
    router = await make_router()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}", options=FLOOD) as channel:
        request = health_pb2.HealthCheckRequest(service="")
        watch = health_pb2_grpc.HealthStub(channel).Watch(request)  # type: ignore[attr-defined]
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(10):
                async for _ in watch:
                    pass
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
    assert time.monotonic() - started < 5  # a few strikes, not the 10 s the test would wait


def test_the_routers_own_stream_pings_respect_the_workers_bound() -> None:
    options = dict(KEEPALIVE_OPTIONS)
    assert options["grpc.keepalive_time_ms"] > MIN_PING_INTERVAL_MS and MAX_PING_STRIKES > 0
