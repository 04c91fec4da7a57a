"""Slow writers and slow readers stay inside the router's memory bounds, and other tenants are served.

- Slow writers: bodies that never finish arriving hold at most `router.tenant_max_receives` of their
  tenant's receive slots (more calls of that tenant are refused `receives_busy`), are cut after
  `router.receive_timeout_s`, and streams beyond `router.tenant_max_streams` are refused unread.
- Slow readers: an answer the client does not read, of `ModelInfer` or of a stream, stays counted in
  `router.max_inflight_bytes` until its call ends, so the budget refuses new work instead of the router
  growing past it.

Before router/receive_gate.py a tenant could keep any number of bodies arriving, and answers left the
budget before gRPC had written them (a non-reading client held them at no cost to the budget). The
clients here are bare HTTP/2 (tests/support/raw_h2.py): a gRPC library always reads and finishes bodies.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import numpy as np

from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import RouterSettings, TenantSettings
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.main import RouterServer
from sluice_inference.router.policy.tenants import hash_api_key
from sluice_inference.router.servicer import ANSWER_COPIES
from tests.integration.conftest import MakeRouter, Spawn
from tests.integration.test_auth_memory import answers, peak_rss
from tests.support.processes import eventually, wait_until
from tests.support.raw_h2 import RawH2, grpc_message
from tests.support.router_process import RouterProcess

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
TENANTS = {
    name: TenantSettings(
        api_keys=[hash_api_key(f"{name}-key")], rate=1e6, burst=1_000_000, max_inflight=100_000
    )
    for name in ("slow", "other")
}
SLOW = {"authorization": "Bearer slow-key"}
UPLOADS = 32
"""Slow 16 MiB uploads of one tenant at once; each sends 15 MiB and stops."""
RSS_BOUND = 150 * 1024 * 1024
"""Growth allowed for the router's peak RSS under `UPLOADS`: two bodies arriving (the default
`router.tenant_max_receives`) and what flow control lets the others send before they are refused.
Measured 22-23 MiB for 16 and 48 uploads; before the receive gate 231 and 667 MiB (~14 MiB per upload)."""


def synthetic_request(rows: int = 1) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="synthetic")
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 16])
    request.raw_input_contents.append(np.ones((rows, 16), "<f4").tobytes())
    return request


async def call(router: RouterServer, key: str, rows: int = 1) -> tuple[str, str, int]:
    """Status name, `sluice-reason` trailer and answer size of one ModelInfer from a well-behaved client."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        try:
            answer = await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                synthetic_request(rows), timeout=20, metadata=(("authorization", f"Bearer {key}"),)
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, str(dict(exc.trailing_metadata() or ()).get("sluice-reason", "")), 0
    return "OK", "", answer.ByteSize()


def refused_for_bytes(router: RouterServer, tenant: str) -> float:
    """Requests of `tenant` the router refused RESOURCE_EXHAUSTED `inflight_bytes`."""
    return sum(
        sample.value
        for metric in router.metrics.rejections.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
        and sample.labels["reason"] == "inflight_bytes"
        and sample.labels["tenant"] == tenant
    )


async def serving_router(make_router: MakeRouter, spawn: Spawn, settings: RouterSettings) -> RouterServer:
    router = await make_router(router=settings, tenants=TENANTS)
    spawn("w1")
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    return router


async def test_slow_writers_hold_their_tenants_slots_only_and_are_cut(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    settings = RouterSettings(
        listen="127.0.0.1:0",
        metrics_port=0,
        tenant_max_receives=2,
        tenant_max_streams=2,
        receive_timeout_s=3.0,
    )
    router = await serving_router(make_router, spawn, settings)
    gate = router.receives
    body = synthetic_request().SerializeToString()
    client = await RawH2.connect(router.port, window=65_535)
    try:
        # Two bodies that claim 1 MiB and stop after 8 KiB, and two streams that never send a message.
        uploads = [
            await client.call(INFER, SLOW, grpc_message(bytes(8 * 1024), declared=2**20), end=False)
            for _ in range(2)
        ]
        streams = [await client.call(STREAM, SLOW, end=False) for _ in range(2)]
        await eventually(
            lambda: gate.receives.held.get("slow") == 2 and gate.streams.held.get("slow") == 2,
            10,
            "the slow calls to hold their tenant's slots",
        )
        started = time.monotonic()
        busy, other, third_stream = await asyncio.gather(
            call(router, "slow-key"),
            call(router, "other-key"),
            client.call(STREAM, SLOW, grpc_message(body), end=False),
        )
        assert busy[:2] == ("RESOURCE_EXHAUSTED", "receives_busy")
        assert time.monotonic() - started < 2.5  # refused after the slot wait, not the receive timeout
        assert other[:2] == ("OK", "")  # another tenant's body is received meanwhile
        await eventually(lambda: third_stream in client.ended, 5, "the stream past the cap to be refused")
        assert third_stream not in client.ended - client.answering  # it was answered (a status), not reset
        await eventually(lambda: set(uploads) <= client.ended, 10, "the slow bodies to be cut")
        assert time.monotonic() - started < 3.0 + 2.0
        assert "slow" not in gate.receives.held
        assert (await call(router, "slow-key"))[:2] == ("OK", "")
        # The cut bodies were never charged; the last answer is given back once its write has completed.
        await eventually(lambda: router.inflight_bytes.used == 0, 5, "the budget to be empty")
        assert not set(streams) & client.ended  # open streams are bounded by count, not cut
    finally:
        await client.close()
    await eventually(lambda: not gate.streams.held and not gate.receives.held, 10, "every slot given back")


async def test_unread_answers_stay_in_the_budget_until_their_calls_end(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    limit = 1024 * 1024
    settings = RouterSettings(
        listen="127.0.0.1:0", metrics_port=0, max_inflight_bytes=limit, tenant_max_receives=64
    )
    router = await serving_router(make_router, spawn, settings)
    status, _, answer_size = await call(router, "other-key", rows=32)
    assert status == "OK"
    held_each = ANSWER_COPIES * answer_size
    body = grpc_message(synthetic_request(rows=32).SerializeToString())
    reader = await RawH2.connect(router.port, window=0)  # announces no window: can read nothing
    try:
        few = [await reader.call(INFER, SLOW, body) for _ in range(40)]
        await eventually(lambda: set(few) <= reader.answering, 20, "the server to answer every call")
        await asyncio.sleep(0.2)  # anything given back early would show by now
        assert reader.data_bytes == 0 and not set(few) & reader.ended
        assert router.inflight_bytes.used >= 40 * held_each * 0.95  # still counted: not written
        assert (await call(router, "other-key", rows=32))[:2] == ("OK", "")  # others are served meanwhile

        more = [await reader.call(INFER, SLOW, body) for _ in range(200)]
        await eventually(
            lambda: set(more) <= reader.answering | reader.ended, 30, "the server to answer or refuse all"
        )
        pinned = len((set(few) | set(more)) - reader.ended)
        assert pinned * held_each * 0.95 <= router.inflight_bytes.used <= limit
        refused = len(set(more) & reader.ended)
        assert refused and refused == refused_for_bytes(router, "slow")  # refused, not held past the budget
    finally:
        await reader.close()
    await eventually(lambda: router.inflight_bytes.used == 0, 10, "the unread answers to be let go")
    assert (await call(router, "other-key", rows=32))[:2] == ("OK", "")


async def test_unread_stream_answers_stay_in_the_budget(make_router: MakeRouter, spawn: Spawn) -> None:
    router = await serving_router(make_router, spawn, RouterSettings(listen="127.0.0.1:0", metrics_port=0))
    status, _, answer_size = await call(router, "other-key", rows=32)
    assert status == "OK"
    message = grpc_message(synthetic_request(rows=32).SerializeToString())
    reader = await RawH2.connect(router.port, window=0)
    try:
        stream = await reader.call(STREAM, SLOW, message * 6, end=False)  # six requests, one DATA frame
        # Six answers are ready; none can be written, so every one of them stays counted.
        await eventually(
            lambda: router.inflight_bytes.used >= 6 * ANSWER_COPIES * answer_size * 0.95,
            20,
            "six unwritten stream answers in the budget",
        )
        await asyncio.sleep(0.2)
        assert stream not in reader.ended and reader.data_bytes == 0
        assert router.inflight_bytes.used >= 6 * ANSWER_COPIES * answer_size * 0.95
    finally:
        await reader.close()
    await eventually(lambda: router.inflight_bytes.used == 0, 10, "the unread answers to be let go")
    assert not router.receives.streams.held


def test_slow_uploads_do_not_grow_the_router(
    etcd_settings: EtcdSettings, cluster_token: str, tmp_path: Path
) -> None:
    config: dict[str, object] = {"tenants": {"slow": {"api_keys": [hash_api_key("slow-key")]}}}
    router = RouterProcess("r-uploads", etcd_settings, tmp_path, config, cluster_token)
    try:
        wait_until(
            lambda: answers(router.addr) or router.process.poll() is not None, 60, "the router to listen"
        )
        assert router.process.poll() is None, router.log()
        before = peak_rss(router.process.pid)

        async def uploads() -> None:
            clients = [await RawH2.connect(router.port, window=65_535) for _ in range(4)]

            async def upload(client: RawH2) -> None:
                head = grpc_message(b"", declared=16 * 1024 * 1024 - 1024)
                stream = await client.call(INFER, SLOW, head, end=False)
                await asyncio.wait_for(client.send(stream, bytes(15 * 1024 * 1024)), 60)

            try:
                await asyncio.gather(*(upload(clients[i % len(clients)]) for i in range(UPLOADS)))
                await asyncio.sleep(1.5)  # past the slot wait: whatever was to be refused is
            finally:
                for client in clients:
                    await client.close()

        asyncio.run(uploads())
        grown = peak_rss(router.process.pid) - before
        assert grown < RSS_BOUND, f"router peak RSS grew by {grown / 2**20:.0f} MiB"
    finally:
        router.kill()
