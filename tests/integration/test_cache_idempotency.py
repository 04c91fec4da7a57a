"""The result cache and idempotency keys on real routers, real workers and a real Redis (Valkey).

Two routers share one Redis; workers are real processes. Worker execution counts come from each
worker's admin Status, so "executed exactly once" is measured where the work happens.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from common.cluster_auth import STATUS_METHOD, ClusterClient
from common.config import CacheSettings, RedisSettings, TenantSettings
from common.pb.inference import grpc_service_pb2 as kserve
from common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc
from router.calls import InferResult, Tensor
from router.codec import decode_call, plain_parameters
from router.kserve_codec import call_from_request
from router.main import RouterServer
from router.policy.tenants import hash_api_key
from router.stored_results import encode_result
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import WorkerProcess, eventually
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

TENANTS = {
    "alice": TenantSettings(api_keys=[hash_api_key("alice-key")], rate=1e6, burst=10**6, max_inflight=10**6),
    "bob": TenantSettings(api_keys=[hash_api_key("bob-key")], rate=1e6, burst=10**6, max_inflight=10**6),
}


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
        "redis": RedisSettings(url=redis.url),
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


async def test_a_planted_wrong_entry_is_caught_by_the_auditor(
    make_router: MakeRouter, spawn: Spawn, redis_server: RedisServer
) -> None:
    routers, _ = await cluster(make_router, spawn, redis_server, "mlp", audit=1.0)
    router = routers[0]
    request = mlp_request(7)
    record = router.catalog.resolve("mlp")
    call = call_from_request(request, metadata=None, time_remaining_s=None)
    decoded = decode_call(call, record)
    lookup = router.cache.lookup("alice", record, decoded, plain_parameters(call.parameters))
    zeros = Tensor("output", "FP32", (1, 10), np.zeros((1, 10), "<f4").tobytes())
    wrong = InferResult(model_name="mlp", model_version=record.version, id="", outputs=(zeros,), served=None)
    await router.cache.store.put(lookup.key, encode_result(wrong), model="mlp", model_version=record.version)
    served = await infer(router, request)
    assert served.parameters["sluice_cache"].string_param == "hit"  # the planted entry was served once...
    await eventually(lambda: record.digest in router.cache.disabled_digests, 10, "the audit to catch it")
    labels = {"model": "mlp", "outcome": "mismatch"}
    assert router.metrics.registry.get_sample_value("sluice_cache_audits_total", labels) == 1
    fresh = await infer(router, request)  # ...and never again: the digest is no longer cached
    assert fresh.parameters["sluice_cache"].string_param == ""
    assert fresh.raw_output_contents[0] != zeros.data


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
    router = await make_router(tenants=TENANTS, redis=RedisSettings(url=redis_server.url))
    old = spawn("w-v1")
    await eventually(lambda: router.driver.core.accepting("w-v1"), 60, "v1 worker")
    original = await infer(router, synthetic_request(5.0), key="roll-1")
    assert original.model_version == "1"
    spawn("w-v2", repository=rolled)
    await eventually(lambda: router.catalog.resolve("synthetic").version == "2", 60, "v2 registered")
    old.stop()
    replay = await infer(router, synthetic_request(5.0), key="roll-1")
    assert replay.parameters["sluice_replayed"].bool_param and replay.model_version == "1"
    assert replay.raw_output_contents == original.raw_output_contents
    assert (await infer(router, synthetic_request(5.0), key="roll-2")).model_version == "2"
