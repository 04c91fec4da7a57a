"""Router membership against real etcd and real worker processes (no mocks of etcd or gRPC).

A worker appears in the router's view within 1 s of registering; a SIGKILLed one disappears within
TTL + 1 s; a drained one leaves at once and exits 0; the router keeps serving while etcd is down.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest

from sluice_inference.common.etcd import WORKERS, open_client
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn
from tests.support.etcd_server import EtcdServer
from tests.support.processes import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def router(make_router: MakeRouter) -> RouterServer:
    """An in-process router on free ports, following the test's etcd."""
    return await make_router()


async def _registered(settings: EtcdSettings) -> set[str]:
    client = await open_client(settings)
    try:
        found = await client.get_prefix((settings.prefix + WORKERS).encode())
    finally:
        await client.close()
    return {kv.key.decode().rsplit("/", 1)[-1] for kv in found}


async def _wait_registered(settings: EtcdSettings, worker_id: str, within_s: float) -> float:
    start = time.monotonic()
    while worker_id not in await _registered(settings):
        assert time.monotonic() - start < within_s, f"{worker_id} never registered"
        await asyncio.sleep(0.02)
    return time.monotonic()


async def _infer(port: int) -> kserve.ModelInferResponse:
    request = kserve.ModelInferRequest(model_name="synthetic")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), "<f4").tobytes())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)


async def test_new_worker_gets_traffic_within_a_second(
    router: RouterServer, spawn: Spawn, etcd_settings: EtcdSettings
) -> None:
    worker = spawn("w-join")
    registered_at = await _wait_registered(etcd_settings, "w-join", within_s=60)
    await eventually(lambda: router.driver.core.accepting("w-join"), 5, "router to accept w-join")
    assert time.monotonic() - registered_at < 1.0
    response = await _infer(router.port)
    assert response.parameters["sluice_worker"].string_param == "w-join"
    assert worker.process.poll() is None


async def test_sigkilled_worker_leaves_within_ttl_plus_one_second(
    router: RouterServer, spawn: Spawn, etcd_settings: EtcdSettings
) -> None:
    worker = spawn("w-kill")
    await _wait_registered(etcd_settings, "w-kill", within_s=60)
    await eventually(lambda: router.driver.core.accepting("w-kill"), 5, "w-kill accepted")
    worker.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    await eventually(lambda: not router.driver.core.accepting("w-kill"), 2, "no traffic to w-kill")
    await eventually(
        lambda: "w-kill" not in router.membership.records, etcd_settings.lease_ttl_s + 2, "w-kill gone"
    )
    assert time.monotonic() - killed_at <= etcd_settings.lease_ttl_s + 1.0


async def test_drained_worker_leaves_at_once_and_exits_zero(
    router: RouterServer, spawn: Spawn, etcd_settings: EtcdSettings
) -> None:
    worker = spawn("w-drain")
    await _wait_registered(etcd_settings, "w-drain", within_s=60)
    await eventually(lambda: router.driver.core.accepting("w-drain"), 5, "w-drain accepted")
    worker.signal(signal.SIGTERM)
    await eventually(lambda: not router.driver.core.accepting("w-drain"), 1, "w-drain stops receiving")
    await eventually(lambda: "w-drain" not in router.membership.records, 2, "w-drain deregistered")
    assert await asyncio.to_thread(worker.wait, 10) == 0, worker.log()


async def test_router_keeps_serving_while_etcd_is_down(
    router: RouterServer, spawn: Spawn, etcd_settings: EtcdSettings, etcd_server: EtcdServer
) -> None:
    spawn("w-steady")
    await _wait_registered(etcd_settings, "w-steady", within_s=60)
    await eventually(lambda: router.driver.core.accepting("w-steady"), 5, "w-steady accepted")
    await asyncio.to_thread(etcd_server.stop)
    deadline = time.monotonic() + etcd_settings.lease_ttl_s + 1.0
    served = 0
    while time.monotonic() < deadline:
        response = await _infer(router.port)
        assert response.parameters["sluice_worker"].string_param == "w-steady"
        served += 1
    assert served > 10
