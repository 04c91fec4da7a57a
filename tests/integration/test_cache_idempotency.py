"""The result cache and idempotency keys on real routers, real workers and a real Redis (Valkey).

Two routers share one Redis (and its HMAC key); workers are real processes. Worker execution counts come
from each worker's admin Status, so "executed exactly once" is measured where the work happens.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from pydantic import SecretStr
from redis.asyncio import Redis

from sluice_inference.common.cluster_auth import STATUS_METHOD, ClusterClient
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc
from sluice_inference.common.serving_settings import CacheSettings, TenantSettings
from sluice_inference.common.trust_settings import RedisSettings
from sluice_inference.router.calls import InferResult, Tensor
from sluice_inference.router.codec import decode_call, plain_parameters
from sluice_inference.router.kserve_codec import call_from_request
from sluice_inference.router.main import RouterServer
from sluice_inference.router.policy.result_cache import encode_entry
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.policy.tenants import hash_api_key
from sluice_inference.router.stored_results import encode_result
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import WorkerProcess, eventually
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

TENANTS = {
    "alice": TenantSettings(api_keys=[hash_api_key("alice-key")], rate=1e6, burst=10**6, max_inflight=10**6),
    "bob": TenantSettings(api_keys=[hash_api_key("bob-key")], rate=1e6, burst=10**6, max_inflight=10**6),
}
HMAC_KEY = "integration-tests-redis-hmac-key-0123456789"


def shared_redis(server: RedisServer) -> RedisSettings:
    """The Redis section every router of a test shares: its URL and the cluster's HMAC key."""
    return RedisSettings(url=server.url, hmac_key=SecretStr(HMAC_KEY))


def synthetic_request(value: float) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="synthetic")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.full((1, 16), value, "<f4").tobytes())
    return request


def mlp_request(seed: int) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 256])
    request.raw_input_contents.append(
        np.random.default_rng(seed).standard_normal((1, 256)).astype("<f4").tobytes()
    )
    return request


async def infer(
    router: RouterServer, request: kserve.ModelInferRequest, tenant: str = "alice", key: str | None = None
) -> kserve.ModelInferResponse:
    metadata = [("authorization", f"Bearer {tenant}-key")]
    if key is not None:
        metadata.append(("idempotency-key", key))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        return await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=20, metadata=metadata
        )


async def executed(workers: list[WorkerProcess], router: RouterServer) -> int:
    """Items executed by the workers, summed (from their admin Status)."""
    total = 0
    for worker_id in [w.worker_id for w in workers]:
        addr = router.membership.records[worker_id].addr
        cluster = ClusterClient(router.config.cluster)
        async with cluster.channel(addr, worker_id) as channel:
            metadata = await cluster.authenticate(channel, worker_id, STATUS_METHOD)
            status = await admin_pb2_grpc.WorkerAdminStub(channel).Status(
                admin_pb2.WorkerStatusRequest(), timeout=5, metadata=metadata
            )
        total += status.items_executed
    return total


async def cluster(
    make_router: MakeRouter, spawn: Spawn, redis: RedisServer, models: str, audit: float = 0.0
) -> tuple[list[RouterServer], list[WorkerProcess]]:
    sections = {
        "tenants": TENANTS,
        "redis": shared_redis(redis),
        "cache": CacheSettings(audit_fraction=audit),
    }
    routers = [await make_router(**sections), await make_router(**sections)]
    workers = [spawn("w-a", models=models), spawn("w-b", models=models)]
    await eventually(
        lambda: all(len(accepting_workers(r)) == 2 for r in routers), 60, "both workers accepted"
    )
    return routers, workers


async def test_one_key_over_two_routers_executes_once_and_answers_identically(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer
) -> None:
    routers, workers = await cluster(make_router, spawn, redis_server, "synthetic")
    before = await executed(workers, routers[0])
    request = synthetic_request(3.0)
    responses = await asyncio.gather(*(infer(routers[i % 2], request, key="order-42") for i in range(50)))
    assert await executed(workers, routers[0]) - before == 1
    outputs = {r.raw_output_contents[0] for r in responses}
    assert len(outputs) == 1
    replayed = [r.parameters["sluice_replayed"].bool_param for r in responses]
    assert replayed.count(False) == 1 and replayed.count(True) == 49
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await infer(routers[1], synthetic_request(4.0), key="order-42")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_tenants_never_share_cache_entries_or_keys(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer
) -> None:
    routers, _ = await cluster(make_router, spawn, redis_server, "mlp")
    first = await infer(routers[0], mlp_request(1), tenant="alice")
    again = await infer(routers[1], mlp_request(1), tenant="alice")
    foreign = await infer(routers[1], mlp_request(1), tenant="bob")
    assert [r.parameters["sluice_cache"].string_param for r in (first, again, foreign)] == [
        "miss",
        "hit",
        "miss",
    ]
    assert again.raw_output_contents == first.raw_output_contents
    mine = await infer(routers[0], mlp_request(2), tenant="alice", key="same-key")
    theirs = await infer(
        routers[0], mlp_request(3), tenant="bob", key="same-key"
    )  # no conflict across tenants
    assert not theirs.parameters["sluice_replayed"].bool_param
    assert theirs.raw_output_contents != mine.raw_output_contents
    bypass = mlp_request(1)
    bypass.parameters["cache"].bool_param = False
    assert (await infer(routers[0], bypass)).parameters["sluice_cache"].string_param == "bypass"


def lookup_key(router: RouterServer, request: kserve.ModelInferRequest, tenant: str) -> str:
    """The cache key a router gives `tenant`'s request."""
    record = router.catalog.resolve(request.model_name)
    call = call_from_request(request, metadata=None, time_remaining_s=None)
    decoded = decode_call(call, record)
    return router.cache.lookup(tenant, record, decoded, plain_parameters(call.parameters)).key


def sample(router: RouterServer, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_planted_wrong_entry_is_quarantined_and_charged_to_the_tenant_that_hit_it(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer
) -> None:
    """An entry the model did not produce (planted through the router's own store, so it is sealed) is
    served once, caught by the audit, removed, and counted against alice; bob's hits are untouched."""
    routers, _ = await cluster(make_router, spawn, redis_server, "mlp", audit=1.0)
    router = routers[0]
    bobs = mlp_request(8)
    await infer(router, bobs, tenant="bob")
    assert (await infer(router, bobs, tenant="bob")).parameters["sluice_cache"].string_param == "hit"
    request = mlp_request(7)
    record = router.catalog.resolve("mlp")
    key = lookup_key(router, request, "alice")
    zeros = Tensor("output", "FP32", (1, 10), np.zeros((1, 10), "<f4").tobytes())
    wrong = InferResult(model_name="mlp", model_version=record.version, id="", outputs=(zeros,), served=None)
    await router.cache.store.put(key, encode_result(wrong), model="mlp", model_version=record.version)
    served = await infer(router, request)
    assert served.parameters["sluice_cache"].string_param == "hit"  # the planted entry was served once...
    await eventually(
        lambda: sample(router, "sluice_cache_audit_mismatches_total", model="mlp", tenant="alice") == 1,
        10,
        "the audit to catch it",
    )
    assert sample(router, "sluice_cache_audits_total", model="mlp", outcome="mismatch") == 1
    assert sample(router, "sluice_cache_audit_mismatches_total", model="mlp", tenant="bob") == 0
    fresh = await infer(router, request)  # ...and never again: the entry is gone, the answer recomputed
    assert fresh.parameters["sluice_cache"].string_param == "miss"
    assert fresh.raw_output_contents[0] != zeros.data
    again = await infer(routers[1], request)  # the other router reads the recomputed entry from Redis
    assert again.parameters["sluice_cache"].string_param == "hit"
    assert again.raw_output_contents == fresh.raw_output_contents
    assert (await infer(router, bobs, tenant="bob")).parameters["sluice_cache"].string_param == "hit"


async def test_an_entry_forged_directly_in_redis_is_a_counted_miss(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer
) -> None:
    """Whoever can write to Redis but lacks `redis.hmac_key` cannot make a router serve a result."""
    routers, _ = await cluster(make_router, spawn, redis_server, "mlp")
    router = routers[1]
    request = mlp_request(21)
    key = lookup_key(router, request, "alice")
    zeros = Tensor("output", "FP32", (1, 10), np.zeros((1, 10), "<f4").tobytes())
    wrong = InferResult(model_name="mlp", model_version="1", id="", outputs=(zeros,), served=None)
    attacker = SealKeys([b"not-the-clusters-key-not-the-clusters-key"])
    forged = encode_entry(key, encode_result(wrong), "1", model="mlp", keys=attacker)
    client = Redis.from_url(redis_server.url)
    try:
        await client.set(f"sluice:cache:{key}", forged)
    finally:
        await client.aclose()
    served = await infer(router, request)
    assert served.parameters["sluice_cache"].string_param == "miss"
    assert served.raw_output_contents[0] != zeros.data
    assert sample(router, "sluice_router_store_integrity_failures_total", store="cache") == 1


async def test_cache_hits_consume_the_tenants_rate_tokens(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer
) -> None:
    """A tenant with a burst of 3 gets three answers, hits included; the fourth is RESOURCE_EXHAUSTED
    although the cache holds it (hits used to skip admission, so they were never rate limited)."""
    tenants = {**TENANTS, "carol": TenantSettings(api_keys=[hash_api_key("carol-key")], rate=0.01, burst=3)}
    router = await make_router(tenants=tenants, redis=shared_redis(redis_server))
    spawn("w-rate", models="mlp")
    await eventually(lambda: len(accepting_workers(router)) == 1, 60, "the worker accepted")
    request = mlp_request(31)
    outcomes = [(await infer(router, request, tenant="carol")).parameters["sluice_cache"].string_param]
    outcomes += [(await infer(router, request, tenant="carol")).parameters["sluice_cache"].string_param]
    outcomes += [(await infer(router, request, tenant="carol")).parameters["sluice_cache"].string_param]
    assert outcomes == ["miss", "hit", "hit"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await infer(router, request, tenant="carol")
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(caught.value.trailing_metadata() or ())["sluice-reason"] == "tenant_rate"
    assert (await infer(router, request, tenant="alice")).parameters["sluice_cache"].string_param == "miss"


async def test_redis_down_fails_keyed_requests_closed_and_cache_just_misses(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer
) -> None:
    routers, _ = await cluster(make_router, spawn, redis_server, "mlp")
    await infer(routers[0], mlp_request(11))
    await asyncio.to_thread(redis_server.stop)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await infer(routers[1], mlp_request(12), key="during-outage")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(caught.value.trailing_metadata() or ())["sluice-reason"] == "idempotency_store_down"
    unkeyed = await infer(routers[1], mlp_request(11))  # Redis held the entry; router 1 never saw it
    assert unkeyed.parameters["sluice_cache"].string_param == "miss"
    assert loop.time() - start < 5.0  # no hang


async def test_replay_after_a_version_roll_returns_the_original_version(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer, demo_repo: Path, tmp_path: Path
) -> None:
    rolled = tmp_path / "rolled"
    shutil.copytree(demo_repo / "synthetic", rolled / "synthetic")
    (rolled / "synthetic" / "2").mkdir()
    config_path = rolled / "synthetic" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["version_policy"] = {"all": True}
    config_path.write_text(yaml.safe_dump(config))
    router = await make_router(tenants=TENANTS, redis=shared_redis(redis_server))
    old = spawn("w-v1")
    await eventually(lambda: router.driver.core.accepting("w-v1"), 60, "v1 worker")
    original = await infer(router, synthetic_request(5.0), key="roll-1")
    assert original.model_version == "1"
    spawn("w-v2", repository=rolled)
    await eventually(lambda: router.catalog.resolve("synthetic").version == "2", 60, "v2 registered")
    # Registered is not yet serving: the router's stream to the new worker opens after its record is seen.
    await eventually(lambda: router.driver.core.accepting("w-v2"), 60, "v2 worker")
    old.stop()
    replay = await infer(router, synthetic_request(5.0), key="roll-1")
    assert replay.parameters["sluice_replayed"].bool_param and replay.model_version == "1"
    assert replay.raw_output_contents == original.raw_output_contents
    assert (await infer(router, synthetic_request(5.0), key="roll-2")).model_version == "2"
