"""What one hostile client could do to a router, tried on a real router and a real worker process: each
request ends with a clear status, the router keeps serving, memory and metric series stay bounded.

Every test here failed on the code of 2026-11-29 (issue 9's table): a uint64 timeout killed the decision
loop, 200,000 repeats of one output copied it 200,000 times, distinct priorities minted Prometheus series,
unparseable bodies answered UNKNOWN with a traceback each, a stream could hang, and batches of nothing but
bad items opened the worker's circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice_inference.common.errors import MAX_MESSAGE_CHARS
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.router.main import RouterServer
from sluice_inference.worker.backends.synthetic import POISON
from tests.integration.conftest import MakeRouter, Spawn
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

RSS_GROWTH_BOUND_MB = 100
"""Stated bound on resident-memory growth of this process (router in-process) around one hostile request
(measured: a few MB; before the fix, +2.6 GB)."""
INFER = "/inference.GRPCInferenceService/ModelInfer"
STATUS_GAUGES = frozenset({
    "sluice_router_token_bucket_level", "sluice_router_quota_share",
    "sluice_router_lane_depth", "sluice_router_lane_oldest_age_seconds",
})  # fmt: skip


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc")


def synthetic_request(rows: int = 1) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="synthetic")
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 16])
    request.raw_input_contents.append(np.ones((rows, 16), "<f4").tobytes())
    return request


async def call(
    port: int, request: kserve.ModelInferRequest, timeout_s: float = 10.0
) -> tuple[grpc.StatusCode, str]:
    """The status code and the `sluice-reason` trailer of one ModelInfer."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        try:
            await stub.ModelInfer(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            trailers = dict(err.trailing_metadata() or ())
            return err.code(), str(trailers.get("sluice-reason", ""))
    return grpc.StatusCode.OK, ""


@pytest.fixture
async def served(make_router: MakeRouter, spawn: Spawn) -> AsyncIterator[RouterServer]:
    """A router with one synthetic worker accepting batches."""
    router = await make_router()
    spawn("w1")
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    yield router


async def test_a_timeout_of_2_to_the_64_is_clamped_and_the_router_keeps_serving(served: RouterServer) -> None:
    hostile = synthetic_request()
    hostile.parameters["timeout"].uint64_param = 2**64 - 1  # clamped to router.max_timeout_s, like a deadline
    assert await call(served.port, hostile) == (grpc.StatusCode.OK, "")
    assert [await call(served.port, synthetic_request()) for _ in range(5)] == [(grpc.StatusCode.OK, "")] * 5
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        probe = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        serving = health_pb2.HealthCheckResponse.SERVING
        for _ in range(50):  # health is refreshed every 0.2 s (1 s while idle): SERVING within 5 s
            health = await probe.Check(request)  # type: ignore[attr-defined]
            if health.status == serving:
                break
            await asyncio.sleep(0.1)
    assert health.status == serving and not served.status.core_stuck


async def test_one_output_listed_200000_times_is_refused_without_amplification(served: RouterServer) -> None:
    hostile = synthetic_request(rows=32)
    for _ in range(200_000):
        hostile.outputs.add(name="y")
    before = rss_mb()
    assert await call(served.port, hostile) == (grpc.StatusCode.INVALID_ARGUMENT, "duplicate_outputs")
    assert rss_mb() - before < RSS_GROWTH_BOUND_MB
    assert await call(served.port, synthetic_request()) == (grpc.StatusCode.OK, "")


async def test_distinct_priorities_mint_no_new_metric_series(served: RouterServer) -> None:
    def series() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        """Series that carry the label this client varies, `priority`. Series labelled only by tenant or
        model are left out: the tenant and the model name are the same in every request here, while the
        worker's registration and the status pass (every 0.2 s) add such series on their own schedule."""
        return {
            (s.name, tuple(sorted(s.labels.items())))
            for metric in served.metrics.registry.collect() if metric.name not in STATUS_GAUGES
            for s in metric.samples if "priority" in s.labels
        }  # fmt: skip

    async def send(priorities: range) -> set[tuple[grpc.StatusCode, str]]:
        statuses = set()
        for priority in priorities:
            request = synthetic_request()
            request.model_name = "no-such-model"  # refused before any quota is spent
            request.parameters["priority"].int64_param = priority
            statuses.add(await call(served.port, request))
        return statuses

    await send(range(1, 111))  # every valid level and 100 invalid ones: every series they can mint
    baseline = series()
    assert await send(range(111, 2111)) == {(grpc.StatusCode.INVALID_ARGUMENT, "bad_priority")}
    assert series() == baseline  # 2,000 more distinct values, not one new series
    labels = {s.labels.get("priority") for m in served.metrics.registry.collect() for s in m.samples}
    assert labels <= {None, "none", "other", *map(str, range(1, 11))}


async def test_a_megabyte_name_comes_back_in_no_status_message_at_its_length(served: RouterServer) -> None:
    """Each of these fields is repeated in its refusal's message; none comes back longer than the bound."""
    huge = "n" * 1_000_000

    def hostile(field: str) -> kserve.ModelInferRequest:
        request = synthetic_request()
        if field == "model_name":
            request.model_name = huge
        elif field == "model_version":
            request.model_version = huge
        elif field == "input_name":
            request.inputs[0].name = huge
        elif field == "datatype":
            request.inputs[0].datatype = huge
        else:
            request.outputs.add(name=huge)
        return request

    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        for field in ("model_name", "model_version", "input_name", "datatype", "output_name"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(hostile(field), timeout=10)
            refusals = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert refused.value.code() in refusals, field
            assert len(refused.value.details() or "") < MAX_MESSAGE_CHARS + 40, field
    assert await call(served.port, synthetic_request()) == (grpc.StatusCode.OK, "")


async def test_unparseable_bodies_are_invalid_argument_and_logged_at_most_once(
    served: RouterServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(INFER)
        codes = set()
        for i in range(50):
            try:
                await raw(b"\xff\xff\xff" + bytes([i]) * 32, timeout=5)
            except grpc.aio.AioRpcError as err:
                codes.add(err.code())
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) <= 1, [r.getMessage() for r in noisy]
    assert not any(r.exc_info for r in noisy)


async def test_every_stream_message_gets_one_answer_and_reading_waits_for_answers(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    router = await make_router(
        router=RouterSettings(listen="127.0.0.1:0", metrics_port=0, stream_max_inflight=4)
    )
    spawn("w1")
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    messages = []
    for i in range(120):
        request = synthetic_request()
        request.id = f"r{i}"
        if i % 10 == 3:
            request.outputs.add(name="y")
            request.outputs.add(name="y")  # INVALID_ARGUMENT, in-band
        messages.append(request)
    deepest = 0

    async def watch_depth() -> None:
        nonlocal deepest
        core = router.driver.core
        while True:
            held = core.queues.queued() + sum(len(d.requests) for d in core.in_flight.values())
            deepest = max(deepest, held)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch_depth())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stream = kserve_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter(messages), timeout=60
            )
            answers = [answer async for answer in stream]
    finally:
        watcher.cancel()
    assert len(answers) == len(messages)
    failed = {a.infer_response.id for a in answers if a.error_message}
    assert failed == {f"r{i}" for i in range(120) if i % 10 == 3}
    assert all(a.error_message.startswith("INVALID_ARGUMENT") for a in answers if a.error_message)
    assert deepest <= 4  # never more of this stream's requests held than its cap


async def test_request_bytes_in_flight_have_a_budget(make_router: MakeRouter, spawn: Spawn) -> None:
    settings = RouterSettings(listen="127.0.0.1:0", metrics_port=0, max_inflight_bytes=1024 * 1024)
    router = await make_router(router=settings)
    spawn("w1")  # ~21 ms per 32-row batch: 300 requests take ~6 s, so most of them wait in flight together
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    big = synthetic_request(rows=32)  # ~2 KiB in and ~2 KiB out: ~4.5 KiB held each, 300 of them ~1.3 MiB
    results = await asyncio.gather(*(call(router.port, big, timeout_s=60) for _ in range(300)))
    refused = [r for r in results if r[0] != grpc.StatusCode.OK]
    assert refused and set(refused) == {(grpc.StatusCode.RESOURCE_EXHAUSTED, "inflight_bytes")}
    assert len(refused) < len(results)
    # Every byte given back. An answer's bytes are released when gRPC reports the call done on the server,
    # which can come after the client has read the answer: wait for it, bounded.
    await eventually(lambda: router.inflight_bytes.used == 0, 10, "every byte given back")


async def test_batches_of_only_bad_items_do_not_take_the_worker_out_of_rotation(served: RouterServer) -> None:
    poison = synthetic_request()
    poison.raw_input_contents[0] = np.full((1, 16), POISON, "<f4").tobytes()
    for _ in range(6):  # twice the breaker's threshold, each batch nothing but a bad item
        assert await call(served.port, poison) == (grpc.StatusCode.INTERNAL, "worker_error")
    breaker = served.driver.core.breaker
    assert breaker.allows("w1", served.clock.now())  # the worker's canary proved it healthy
    assert await call(served.port, synthetic_request()) == (grpc.StatusCode.OK, "")
