"""What etcd holds is read as hostile input (docs/security.md, "an attacker who can write etcd"): a value
that would exhaust the JSON parser, overflow a float or fill memory is skipped, the watch that read it
goes on, and so do the decisions that depend on it — a key revoked after the poison is still revoked."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from sluice_inference.common.clock import MonotonicClock
from sluice_inference.common.etcd import ROUTERS, TENANTS, open_client
from sluice_inference.common.etcd_watch import MAX_VALUE_BYTES, WatchHealth, follow_prefix
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import TenantSettings
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.peers import router_record
from sluice_inference.router.policy.demand import Demand
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

POISON = b"[" * 100_000
"""Deep enough to raise RecursionError in json.loads (it ended the router's `tenants/` watch for good)."""
GOLD = {"gold": TenantSettings(api_keys=[hash_api_key("gold-key")], models=["*"])}


async def status_of(port: int, key: str) -> grpc.StatusCode:
    """The status a ModelInfer with `key` ends with (no worker runs: an accepted key gets NOT_FOUND)."""
    request = kserve.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 256])
    request.raw_input_contents.append(np.zeros((1, 256), "<f4").tobytes())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                request, timeout=5, metadata=(("authorization", f"Bearer {key}"),)
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_a_poisoned_tenant_value_leaves_key_revocation_working(
    make_router: MakeRouter, etcd_settings: EtcdSettings
) -> None:
    router = await make_router(tenants=GOLD)
    assert await status_of(router.port, "gold-key") == grpc.StatusCode.NOT_FOUND  # the key is accepted
    client = await open_client(etcd_settings)
    try:
        folder = etcd_settings.prefix + TENANTS
        await client.put((folder + "zzz").encode(), POISON)
        await client.put((folder + "gold").encode(), b'{"api_keys": []}')  # revoke every key of gold

        async def revoked() -> bool:
            return await status_of(router.port, "gold-key") == grpc.StatusCode.UNAUTHENTICATED

        for _ in range(50):
            if await revoked():
                break
            await asyncio.sleep(0.1)
        assert await revoked(), "the revocation written after the poison was never applied"
        assert all(watch.running for watch in router.peers.watches)
    finally:
        await client.close()


async def test_poisoned_router_records_count_as_routers_without_demand_and_the_watch_goes_on(
    make_router: MakeRouter, etcd_settings: EtcdSettings
) -> None:
    router = await make_router(tenants=GOLD)
    client = await open_client(etcd_settings)
    try:
        folder = etcd_settings.prefix + ROUTERS
        overflow = b'{"addr": "h:1", "demand": {"tenants": {"gold": 1' + b"0" * 400 + b"}}}"
        await client.put((folder + "deep").encode(), POISON)
        await client.put((folder + "overflow").encode(), overflow)
        await client.put((folder + "peer").encode(), router_record("h:2", Demand({"gold": 5.0}, 5.0)))
        await eventually(lambda: router.peers.routers == 4, 5, "every record counted")
        assert router.peers.peers["peer"] == Demand({"gold": 5.0}, 5.0)
        assert router.peers.peers["deep"] == Demand() == router.peers.peers["overflow"]
    finally:
        await client.close()


async def test_a_failing_consumer_is_restarted_on_a_fresh_snapshot_and_big_values_never_reach_it(
    etcd_settings: EtcdSettings,
) -> None:
    prefix = etcd_settings.prefix + "probe/"
    health = WatchHealth("probe")
    seen: list[dict[str, bytes]] = []
    failures = 2

    def apply(snapshot: dict[str, bytes]) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise RuntimeError("a bug in the consumer")
        seen.append(snapshot)

    client = await open_client(etcd_settings)
    task = asyncio.create_task(follow_prefix(etcd_settings, prefix, apply, health, MonotonicClock()))
    try:
        await client.put((prefix + "big").encode(), b"x" * (MAX_VALUE_BYTES + 1))
        await client.put((prefix + "a").encode(), b"1")
        await eventually(
            lambda: health.running and bool(seen) and "a" in seen[-1], 10, "the consumer applying"
        )
        assert health.restarts == 2
        assert all("big" not in snapshot for snapshot in seen) and health.skipped >= 1
        await client.put((prefix + "b").encode(), b"2")
        await eventually(lambda: "b" in seen[-1], 5, "a later change applied")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
