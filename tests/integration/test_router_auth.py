"""The client port's gate (router/auth.py) on a real router: admin RPCs need an admin credential,
model metadata respects the tenant's model globs, probes stay open, and key-less local mode keeps
admin open.
"""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sluice_inference.common.grpc_errors import REASON_KEY
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc
from sluice_inference.common.serving_settings import RouterSettings, TenantSettings
from sluice_inference.router.main import RouterServer
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter, Spawn
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

KEYED = {
    "gold": TenantSettings(api_keys=[hash_api_key("gold-key")], models=["synthetic"]),
    "ops": TenantSettings(api_keys=[hash_api_key("ops-key")], admin=True),
}
ROOT_ADMIN = "root-admin-key"

ADMIN_REQUESTS: dict[str, Any] = {
    "ListTenants": admin_pb2.ListTenantsRequest(),
    "ListWorkers": admin_pb2.ListWorkersRequest(),
    "GetStats": admin_pb2.GetStatsRequest(),
    "PurgeCache": admin_pb2.PurgeCacheRequest(model="synthetic"),
}


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def keyed_router(make_router: MakeRouter) -> RouterServer:
    return await make_router(
        tenants=KEYED,
        router=RouterSettings(listen="127.0.0.1:0", metrics_port=0, admin_keys=[hash_api_key(ROOT_ADMIN)]),
    )


async def admin_outcome(router: RouterServer, method: str, metadata: Any) -> tuple[grpc.StatusCode, str]:
    """The status code (and reason trailer) an admin call ends with."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        try:
            stub: Any = admin_pb2_grpc.RouterAdminStub(channel)
            await getattr(stub, method)(ADMIN_REQUESTS[method], timeout=5, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            trailers = dict(exc.trailing_metadata() or ())
            return exc.code(), str(trailers.get(REASON_KEY, ""))
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("method", sorted(ADMIN_REQUESTS))
async def test_admin_rpcs_need_an_admin_credential(make_router: MakeRouter, method: str) -> None:
    router = await keyed_router(make_router)
    assert await admin_outcome(router, method, ()) == (grpc.StatusCode.UNAUTHENTICATED, "missing_admin_key")
    assert (await admin_outcome(router, method, bearer("nobody-key")))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert await admin_outcome(router, method, bearer("gold-key")) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "not_admin",
    )
    assert (await admin_outcome(router, method, bearer("ops-key")))[0] == grpc.StatusCode.OK  # admin role
    assert (await admin_outcome(router, method, bearer(ROOT_ADMIN)))[0] == grpc.StatusCode.OK  # admin key


@pytest.mark.parametrize("method", sorted(ADMIN_REQUESTS))
async def test_key_less_local_mode_keeps_admin_open(make_router: MakeRouter, method: str) -> None:
    router = await make_router()  # the default: an anonymous tenant, no keys anywhere
    assert (await admin_outcome(router, method, ()))[0] == grpc.StatusCode.OK


async def test_probes_stay_open_on_a_keyed_router(make_router: MakeRouter) -> None:
    router = await keyed_router(make_router)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status in (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        assert (await stub.ServerLive(kserve.ServerLiveRequest(), timeout=5)).live
        await stub.ServerReady(kserve.ServerReadyRequest(), timeout=5)
        assert (await stub.ServerMetadata(kserve.ServerMetadataRequest(), timeout=5)).name == "sluice"


async def test_reflection_stays_open_and_lists_the_services(make_router: MakeRouter) -> None:
    """Reflection (for grpcurl and generic clients) answers without a key on a keyed router."""
    router = await keyed_router(make_router)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        stub: Any = reflection_pb2_grpc.ServerReflectionStub(cast(Any, channel))  # stubs type a sync channel
        asked = reflection_pb2.ServerReflectionRequest(list_services="")
        answers = [answer async for answer in stub.ServerReflectionInfo(iter([asked]), timeout=5)]
    listed = {service.name for service in answers[0].list_services_response.service}
    assert {"inference.GRPCInferenceService", "sluice.v1.RouterAdmin", "grpc.health.v1.Health"} <= listed


async def test_model_metadata_and_ready_respect_the_tenants_models(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    router = await keyed_router(make_router)
    spawn("w1", models="synthetic,mlp")
    await eventually(lambda: router.driver.core.accepting("w1"), 60, "w1 accepting")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        stub: Any = kserve_grpc.GRPCInferenceServiceStub(channel)

        async def outcome(call: str, model: str, metadata: Any) -> grpc.StatusCode:
            try:
                if call == "ModelMetadata":
                    await stub.ModelMetadata(
                        kserve.ModelMetadataRequest(name=model), timeout=5, metadata=metadata
                    )
                else:
                    await stub.ModelReady(kserve.ModelReadyRequest(name=model), timeout=5, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        for call in ("ModelMetadata", "ModelReady"):
            assert await outcome(call, "synthetic", bearer("gold-key")) == grpc.StatusCode.OK
            assert await outcome(call, "mlp", bearer("gold-key")) == grpc.StatusCode.PERMISSION_DENIED, call
            # outside the globs, existence is not revealed: the same answer for a model nobody serves
            assert (
                await outcome(call, "no-such-model", bearer("gold-key")) == grpc.StatusCode.PERMISSION_DENIED
            )
            assert await outcome(call, "mlp", bearer("ops-key")) == grpc.StatusCode.OK
            assert await outcome(call, "synthetic", ()) == grpc.StatusCode.UNAUTHENTICATED
            assert await outcome(call, "synthetic", bearer("nobody-key")) == grpc.StatusCode.UNAUTHENTICATED
