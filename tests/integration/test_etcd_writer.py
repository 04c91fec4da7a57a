"""An attacker who can write etcd (docs/security.md, "An attacker who can write etcd"), against a real
etcd and a real router: a tenant override cannot grant admin, add a key or create a tenant, while the
revocation written in the same value applies; fake router records cannot push the router's quota share
below share_floor / max_routers."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from sluice_inference.common.etcd import ROUTERS, TENANTS, open_client
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc
from sluice_inference.common.serving_settings import AdmissionSettings, TenantSettings
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter
from tests.integration.test_etcd_values import status_of
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

GOLD = {
    "gold": TenantSettings(
        api_keys=[hash_api_key("old-key"), hash_api_key("new-key")], rate=100, burst=10, models=["*"]
    )
}


async def admin_status(port: int, key: str) -> grpc.StatusCode:
    """The status `RouterAdmin/ListWorkers` with `key` ends with."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            await admin_pb2_grpc.RouterAdminStub(channel).ListWorkers(
                admin_pb2.ListWorkersRequest(), timeout=5, metadata=(("authorization", f"Bearer {key}"),)
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_an_override_cannot_grant_admin_add_a_key_or_create_a_tenant_but_revokes(
    make_router: MakeRouter, etcd_settings: EtcdSettings
) -> None:
    router = await make_router(tenants=GOLD)
    assert await admin_status(router.port, "new-key") == grpc.StatusCode.PERMISSION_DENIED
    folder = etcd_settings.prefix + TENANTS
    grant = {"admin": True, "api_keys": [hash_api_key("new-key"), hash_api_key("mallory-key")]}
    client = await open_client(etcd_settings)
    try:
        await client.put((folder + "gold").encode(), json.dumps(grant).encode())
        await client.put((folder + "mallory").encode(), json.dumps(grant).encode())

        async def revoked() -> bool:
            return await status_of(router.port, "old-key") == grpc.StatusCode.UNAUTHENTICATED

        for _ in range(50):
            if await revoked():
                break
            await asyncio.sleep(0.1)
        assert await revoked(), "the revocation written beside the grant was not applied"
        assert await status_of(router.port, "new-key") == grpc.StatusCode.NOT_FOUND  # still a tenant key
        assert await admin_status(router.port, "new-key") == grpc.StatusCode.PERMISSION_DENIED
        assert await status_of(router.port, "mallory-key") == grpc.StatusCode.UNAUTHENTICATED
        assert set(router.peers.current_directory().names()) == {"gold"}
    finally:
        await client.close()


async def test_fake_router_records_cannot_push_the_share_below_the_floor_over_max_routers(
    make_router: MakeRouter, etcd_settings: EtcdSettings
) -> None:
    max_routers = 4
    admission = AdmissionSettings(max_routers=max_routers, share_floor=0.1)
    router = await make_router(tenants=GOLD, admission=admission)
    greedy = json.dumps({"addr": "10.0.0.1:8001", "demand": {"tenants": {"gold": 1e12}, "total": 1e12}})
    client = await open_client(etcd_settings)
    try:
        for k in range(40):
            await client.put(f"{etcd_settings.prefix}{ROUTERS}fake-{k}".encode(), greedy.encode())
        await eventually(lambda: router.peers.routers == 41, 5, "every fake record read")
    finally:
        await client.close()
    limiter = router.driver.core.admission.limiter
    # Shares follow the view while the router's own registration reaches etcd (not stale).
    await eventually(lambda: not router.peers.stale and limiter.routers == max_routers, 10, "counted")
    assert limiter.rate_share("gold") >= 100 * 0.1 / max_routers - 1e-9
