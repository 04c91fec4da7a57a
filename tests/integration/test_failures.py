"""Failures end as explicit per-request outcomes: a poison item fails alone, a worker killed mid-batch
has its requests re-dispatched, frozen workers leave within TTL + 1 s and broken streams are noticed
within the heartbeat's bound (1.55 s for an idle worker)."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest

from sluice_inference.common.heartbeat import silence_bound_s
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.main import RouterServer
from sluice_inference.worker.backends.synthetic import POISON
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

TIMER_SLACK_S = 0.2
"""How late the router's silence timer and this test's polling may notice, together."""


def request(value: float) -> kserve.ModelInferRequest:
    message = kserve.ModelInferRequest(model_name="synthetic")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    message.raw_input_contents.append(np.full((1, 16), value, "<f4").tobytes())
    return message


async def call(
    router: RouterServer, message: kserve.ModelInferRequest
) -> kserve.ModelInferResponse | grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        try:
            return await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def test_a_poison_item_fails_alone_and_its_batch_mates_succeed(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    router = await make_router()
    spawn("w-poison")
    await eventually(lambda: router.driver.core.accepting("w-poison"), 60, "worker accepted")
    results = await asyncio.gather(
        *(call(router, request(POISON if i == 5 else float(i))) for i in range(12))
    )
    assert results[5] == grpc.StatusCode.INTERNAL
    ok = [r for i, r in enumerate(results) if i != 5 and isinstance(r, kserve.ModelInferResponse)]
    assert len(ok) == 11
    assert any(r.parameters["sluice_batch_size"].int64_param > 1 for r in ok)  # they really shared batches


async def test_requests_of_a_worker_killed_mid_batch_are_redispatched(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    router = await make_router()
    doomed = spawn("w-doomed", slowdown=40.0)  # 5 ms base -> 200 ms: batches stay in flight
    spawn("w-steady")
    await eventually(lambda: len(accepting_workers(router)) == 2, 60, "both workers accepted")
    calls = [asyncio.create_task(call(router, request(float(i)))) for i in range(40)]
    await eventually(
        lambda: router.driver.core.in_flight_on("w-doomed") > 0, 10, "a batch on the doomed worker"
    )
    doomed.signal(signal.SIGKILL)
    results = await asyncio.gather(*calls)
    assert all(isinstance(r, kserve.ModelInferResponse) for r in results), results
    assert router.metrics.registry.get_sample_value(
        "sluice_router_redispatched_total", {"model": "synthetic"}
    )


async def test_a_frozen_worker_leaves_within_ttl_plus_one_second(
    make_router: MakeRouter, spawn: Spawn, etcd_settings: EtcdSettings
) -> None:
    router = await make_router()
    frozen = spawn("w-frozen")
    await eventually(lambda: router.driver.core.accepting("w-frozen"), 60, "worker accepted")
    link = router.links.get("w-frozen")
    assert link is not None
    await eventually(  # idle: it reports once a second (the default), and says so
        lambda: link.last_load is not None and link.last_load.report_interval_ms > 900, 5, "slow reports"
    )
    frozen.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    stream_gone = await eventually(lambda: not router.driver.core.accepting("w-frozen"), 4, "no traffic")
    # Silent past the announced interval plus the margin closes the stream (gRPC's keepalive may be first).
    assert stream_gone <= silence_bound_s(1000) + TIMER_SLACK_S
    await eventually(
        lambda: "w-frozen" not in router.membership.records, etcd_settings.lease_ttl_s + 2, "lease gone"
    )
    assert time.monotonic() - stopped_at <= etcd_settings.lease_ttl_s + 1.0
