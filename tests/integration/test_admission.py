"""Admission through a real router (in-process) with a real worker and etcd: tenants, quotas, hints,
and equal quota shares across two routers (shares that follow demand: test_quota_shares.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2

from sluice_inference.common.etcd import TENANTS as TENANTS_FOLDER
from sluice_inference.common.etcd import open_client
from sluice_inference.common.grpc_errors import DETAILS_KEY, PUSHBACK_KEY
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import AdmissionSettings, TenantSettings
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.main import RouterServer
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter, Spawn
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

TENANTS = {
    "gold": TenantSettings(api_keys=[hash_api_key("gold-key")], models=["synthetic"], rate=20, burst=4),
    "other": TenantSettings(api_keys=[hash_api_key("other-key")], models=["mlp"]),
}


async def call(
    router: RouterServer, key: str | None, model: str = "synthetic"
) -> grpc.aio.AioRpcError | None:
    request = kserve.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), "<f4").tobytes())
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        try:
            await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                request, timeout=10, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


async def ready_router(make_router: MakeRouter, spawn: Spawn, **sections: object) -> RouterServer:
    router = await make_router(tenants=TENANTS, **sections)
    spawn("w-adm")
    await eventually(lambda: router.driver.core.accepting("w-adm"), 60, "worker accepted")
    return router


async def test_tenants_are_authenticated_and_authorized(make_router: MakeRouter, spawn: Spawn) -> None:
    router = await ready_router(make_router, spawn)
    assert await call(router, "gold-key") is None
    for key, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("stolen", grpc.StatusCode.UNAUTHENTICATED)):
        error = await call(router, key)
        assert error is not None and error.code() == code
    error = await call(router, "other-key", model="synthetic")
    assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_rate_limit_answers_resource_exhausted_with_both_retry_hints(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    router = await ready_router(make_router, spawn)
    results = await asyncio.gather(*(call(router, "gold-key") for _ in range(10)))
    errors = [e for e in results if e is not None]
    assert len(errors) >= 5 and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
    trailers = dict(errors[0].trailing_metadata() or ())
    assert 0 < int(trailers[PUSHBACK_KEY]) <= 1000
    status = status_pb2.Status.FromString(trailers[DETAILS_KEY])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.retry_delay.ToMilliseconds() == int(trailers[PUSHBACK_KEY])


async def test_with_equal_shares_two_routers_each_enforce_half_and_rebalance_when_one_leaves(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    equal = AdmissionSettings(quota_shares="equal")  # shares that follow demand: test_quota_shares.py
    first = await ready_router(make_router, spawn, admission=equal)
    second = await make_router(tenants=TENANTS, admission=equal)
    await eventually(
        lambda: first.peers.routers == 2 and second.peers.routers == 2, 2, "both routers counted"
    )
    assert first.driver.core.admission.limiter.levels(first.clock.now())["gold"] <= 2.0  # half the burst of 4
    admitted = 0
    start = time.monotonic()
    while time.monotonic() - start < 2.0:  # 2 s of pressure on one router: share 10 req/s + burst 2
        admitted += await call(first, "gold-key") is None
        await asyncio.sleep(0.01)
    assert 20 <= admitted <= 27, admitted
    await second.stop()
    waited = await eventually(lambda: first.peers.routers == 1, 2, "first router alone again")
    assert waited < 1.0  # a clean stop revokes the lease: shares rebalance at once


def gold_allows(router: RouterServer, model: str) -> bool:
    tenant = router.peers.current_directory().get("gold")
    assert tenant is not None
    return tenant.allows(model)


async def test_live_tenant_overrides_from_etcd_apply_without_restart(
    make_router: MakeRouter, spawn: Spawn, etcd_settings: EtcdSettings
) -> None:
    router = await ready_router(make_router, spawn)
    assert await call(router, "gold-key") is None
    client = await open_client(etcd_settings)
    try:
        await client.put((etcd_settings.prefix + TENANTS_FOLDER + "gold").encode(), b'{"models": ["mlp"]}')
        await eventually(lambda: not gold_allows(router, "synthetic"), 2, "override")
        error = await call(router, "gold-key")
        assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED
        await client.put(
            (etcd_settings.prefix + TENANTS_FOLDER + "gold").encode(), b'{"models": ["*"], "rate": 0}'
        )
        await asyncio.sleep(0.3)  # an invalid override (rate must be > 0) is ignored, not half-applied
        assert not gold_allows(router, "synthetic")
        await client.delete((etcd_settings.prefix + TENANTS_FOLDER + "gold").encode())
        await eventually(lambda: gold_allows(router, "synthetic"), 2, "reverted")
    finally:
        await client.close()
