"""The worker port (docs/design.md §9): a worker runs only batches it can trace to a router of its cluster.

Real `sluice worker` processes, dialled straight on their registered port as an attacker on the network
would: without a proof of the cluster token (or a certificate from the cluster CA naming a router)
`WorkerAdmin/*` and `Worker/Stream` are refused before anything is read; the token itself is no longer
a credential on the wire; a proof is good for one method, once; with a proof they work; health and the
identity challenge stay open. Under mTLS a router accepts only the certificate of the worker id it dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import SecretStr

from sluice_inference.common.cluster_auth import STATUS_METHOD, STREAM_METHOD, ClusterClient, challenge
from sluice_inference.common.cluster_proof import derive_key, server_transcript
from sluice_inference.common.dev_certs import write_dev_certs
from sluice_inference.common.etcd import WORKERS, EtcdUnavailable, open_client, worker_key
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluice_inference.common.records import WorkerRecord
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings
from tests.integration.conftest import MakeRouter, Spawn
from tests.integration.test_cache_idempotency import synthetic_request
from tests.support.processes import WorkerProcess, eventually

pytestmark = pytest.mark.integration

BIG = 8 * 1024 * 1024
"""A batch message above gRPC's default 4 MiB receive limit, below `cluster.max_message_bytes`."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cluster's development CA and certificates."""
    folder = tmp_path_factory.mktemp("cluster-certs")
    write_dev_certs(folder, ("w-tls",))
    return folder


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates from another CA (valid, but not the cluster's)."""
    folder = tmp_path_factory.mktemp("other-certs")
    write_dev_certs(folder)
    return folder


async def registered_addr(etcd: EtcdSettings, worker_id: str, within_s: float = 60) -> str:
    """The address a worker registered in etcd (waits for it)."""
    found: dict[str, str] = {}

    async def look() -> None:
        client = await open_client(etcd)
        try:
            for kv in await client.get_prefix((etcd.prefix + WORKERS).encode()):
                record = WorkerRecord.from_json(kv.value)
                found[record.worker_id] = record.addr
        finally:
            await client.close()

    deadline = asyncio.get_running_loop().time() + within_s
    while worker_id not in found:
        assert asyncio.get_running_loop().time() < deadline, f"{worker_id} never registered"
        # A connection attempt can time out on a loaded machine (CI saw "handshaker shutdown"): the
        # worker's registration is what is waited for, not any one read of it.
        with contextlib.suppress(EtcdUnavailable):
            await look()
        await asyncio.sleep(0.1)
    return found[worker_id]


def code_of(exc: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> grpc.StatusCode:
    return exc.value.code()


async def status(channel: grpc.aio.Channel, metadata: Any = ()) -> admin_pb2.WorkerStatusResponse:
    return await admin_pb2_grpc.WorkerAdminStub(channel).Status(
        admin_pb2.WorkerStatusRequest(), timeout=5, metadata=metadata
    )


def not_found_items(message: worker_pb2.WorkerMessage) -> list[int]:
    """The items of batch 7 answered NOT_FOUND (every one of them, when the worker read the batch)."""
    [result] = message.results
    assert result.batch_id == 7 and not result.item_ids
    return [e.item_id for e in result.errors if e.code == grpc.StatusCode.NOT_FOUND.value[0]]


def big_batch() -> worker_pb2.RouterMessage:
    """One batch of two 4 MiB items for a model the worker does not serve (each item → NOT_FOUND)."""
    x = worker_pb2.BatchTensor(name="x", datatype="UINT8", row_shape=[BIG // 2], data=bytes(BIG))
    batch = worker_pb2.Batch(
        batch_id=7, model="not-served", version="1", item_ids=[1, 2], item_rows=[1, 1],
        budgets_us=[5_000_000] * 2, inputs=[x],
    )  # fmt: skip
    return worker_pb2.RouterMessage(batches=[batch])


def test_a_worker_without_credentials_refuses_to_start(
    demo_repo: Path, etcd_settings: EtcdSettings, tmp_path: Path
) -> None:
    worker = WorkerProcess("w-bare", demo_repo, etcd_settings, tmp_path, models="synthetic")
    try:
        assert worker.wait(60) == 1, worker.log()
        assert "cluster.token" in worker.log() and "mTLS" in worker.log()
    finally:
        worker.stop()


async def test_token_gate_on_admin_and_stream(
    spawn: Spawn, etcd_settings: EtcdSettings, cluster_token: str
) -> None:
    spawn("w-token")
    addr = await registered_addr(etcd_settings, "w-token")
    cluster = ClusterClient(ClusterSettings(token=SecretStr(cluster_token)))
    async with cluster.channel(addr, "w-token", [("grpc.max_send_message_length", 2 * BIG)]) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)  # type: ignore[attr-defined]
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no credential

        # The worker proves itself first: its answer to our challenge checks out under the token.
        nonce, reply = await challenge(channel, "admin")
        assert reply.identity == "workers/w-token"
        transcript = server_transcript("admin", "workers/w-token", nonce, reply.nonce)
        assert hmac.new(derive_key(cluster_token), transcript, hashlib.sha256).digest() in reply.token_proofs

        # No proof, or the token itself (what routers used to send), is refused.
        for metadata in ((), (("sluice-cluster-token", cluster_token),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await status(channel, metadata)
            assert code_of(refused) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin_pb2_grpc.WorkerAdminStub(channel).Drain(
                    admin_pb2.DrainRequest(), timeout=5, metadata=metadata
                )
            assert code_of(refused) == grpc.StatusCode.UNAUTHENTICATED
        # A proof made for Status does not drain (it names its method), and is good once.
        for_status = await cluster.authenticate(channel, "w-token", STATUS_METHOD)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin_pb2_grpc.WorkerAdminStub(channel).Drain(
                admin_pb2.DrainRequest(), timeout=5, metadata=for_status
            )
        assert code_of(refused) == grpc.StatusCode.UNAUTHENTICATED
        before = await status(channel, for_status)
        assert before.state == worker_pb2.WORKER_STATE_READY  # the refused Drains did nothing
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await status(channel, for_status)  # replayed
        assert code_of(refused) == grpc.StatusCode.UNAUTHENTICATED

        # A stream without a proof ends UNAUTHENTICATED before the caller sends anything: the worker
        # does not wait for (or read) a batch to refuse it.
        never = asyncio.Event()

        async def nothing() -> AsyncIterator[worker_pb2.RouterMessage]:
            await never.wait()
            yield worker_pb2.RouterMessage()

        async def one_batch() -> AsyncIterator[worker_pb2.RouterMessage]:
            yield big_batch()
            await never.wait()

        call = worker_pb2_grpc.WorkerStub(channel).Stream(nothing(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
        assert code_of(refused) == grpc.StatusCode.UNAUTHENTICATED
        # A batch sent anyway: refused too. The worker ends the call at once, so our own write of the batch
        # may race with that end and fail here first (INTERNAL: "Failed execute_batch", client side).
        call = worker_pb2_grpc.WorkerStub(channel).Stream(one_batch(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
        assert code_of(refused) in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
        after = await status(channel, await cluster.authenticate(channel, "w-token", STATUS_METHOD))
        assert after.batches_executed == before.batches_executed  # nothing ran for the refused calls

        # With a proof for the stream the same 8 MiB batch is read (above gRPC's 4 MiB default) and answered.
        proof = await cluster.authenticate(channel, "w-token", STREAM_METHOD)
        call = worker_pb2_grpc.WorkerStub(channel).Stream(one_batch(), timeout=10, metadata=proof)
        async for message in call:
            if message.results:
                assert not_found_items(message) == [1, 2]
                call.cancel()
                break
        else:
            raise AssertionError("the stream ended without a result")


@pytest.fixture
def tls_worker(
    demo_repo: Path, etcd_settings: EtcdSettings, certs: Path, tmp_path: Path
) -> Iterator[WorkerProcess]:
    """A worker serving mTLS with the cluster CA, and no token."""
    env = {
        "SLUICE_CLUSTER__CA_FILE": str(certs / "ca.pem"),
        "SLUICE_CLUSTER__CERT_FILE": str(certs / "workers" / "w-tls.pem"),
        "SLUICE_CLUSTER__KEY_FILE": str(certs / "workers" / "w-tls-key.pem"),
    }
    worker = WorkerProcess("w-tls", demo_repo, etcd_settings, tmp_path, models="synthetic", env=env)
    yield worker
    worker.stop()


def client_credentials(ca: Path, cert: str | None, folder: Path) -> grpc.ChannelCredentials:
    """TLS trusting `ca`, presenting `folder/<cert>.pem` (None: no client certificate)."""
    if cert is None:
        return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=(folder / f"{cert}-key.pem").read_bytes(),
        certificate_chain=(folder / f"{cert}.pem").read_bytes(),
    )


async def test_mtls_accepts_only_client_certificates_of_the_cluster_ca(
    tls_worker: WorkerProcess, etcd_settings: EtcdSettings, certs: Path, other_certs: Path
) -> None:
    addr = await registered_addr(etcd_settings, "w-tls")
    ca = certs / "ca.pem"
    async with grpc.aio.secure_channel(addr, client_credentials(ca, "router-client", certs)) as channel:
        assert (await status(channel)).worker_id == "w-tls"
    async with grpc.aio.secure_channel(addr, client_credentials(ca, "admin-client", certs)) as channel:
        assert (await status(channel)).worker_id == "w-tls"
    refused = {
        "no client certificate": grpc.aio.secure_channel(addr, client_credentials(ca, None, certs)),
        "a certificate from another CA": grpc.aio.secure_channel(
            addr, client_credentials(ca, "router-client", other_certs)
        ),
        "plaintext": grpc.aio.insecure_channel(addr),
    }
    for what, channel in refused.items():
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await status(channel)
            assert code_of(failed) == grpc.StatusCode.UNAVAILABLE, what
    # An operator's certificate may call WorkerAdmin, not open a stream: streams are for routers.
    never = asyncio.Event()

    async def nothing() -> AsyncIterator[worker_pb2.RouterMessage]:
        await never.wait()
        yield worker_pb2.RouterMessage()

    async with grpc.aio.secure_channel(addr, client_credentials(ca, "admin-client", certs)) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Stream(nothing(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in call:
                pass
        assert code_of(failed) == grpc.StatusCode.PERMISSION_DENIED


async def test_a_router_streams_batches_to_a_worker_over_mtls(
    make_router: MakeRouter, tls_worker: WorkerProcess, certs: Path
) -> None:

    cluster = ClusterSettings(
        ca_file=certs / "ca.pem",
        cert_file=certs / "router-client.pem",
        key_file=certs / "router-client-key.pem",
    )
    router = await make_router(router=RouterSettings(listen="127.0.0.1:0", metrics_port=0), cluster=cluster)
    await eventually(lambda: router.driver.core.accepting("w-tls"), 60, "w-tls accepting")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        reply = await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            synthetic_request(1.0), timeout=10
        )
    assert reply.parameters["sluice_worker"].string_param == "w-tls"


async def test_a_router_refuses_a_worker_certificate_issued_to_another_id(
    make_router: MakeRouter, tls_worker: WorkerProcess, etcd_settings: EtcdSettings, certs: Path
) -> None:
    """A record `workers/w-imposter` pointing at w-tls: the worker there presents a valid certificate of
    the cluster CA, but one naming `w-tls.worker.sluice`, so the router never takes it as w-imposter."""
    cluster = ClusterSettings(
        ca_file=certs / "ca.pem",
        cert_file=certs / "router-client.pem",
        key_file=certs / "router-client-key.pem",
    )
    router = await make_router(router=RouterSettings(listen="127.0.0.1:0", metrics_port=0), cluster=cluster)
    await eventually(lambda: router.driver.core.accepting("w-tls"), 60, "w-tls accepting")
    real = router.membership.records["w-tls"]
    client = await open_client(etcd_settings)
    try:
        imposter = real.model_copy(update={"worker_id": "w-imposter"})
        await client.put(worker_key(etcd_settings.prefix, "w-imposter").encode(), imposter.to_json())
        await eventually(lambda: "w-imposter" in router.membership.records, 10, "the imposter's record seen")
        await asyncio.sleep(2.0)  # several connection attempts (backoff from 0.1 s)
        assert not router.driver.core.accepting("w-imposter")
        assert router.membership.load_of("w-imposter") is None  # no stream ever opened
        assert router.driver.core.accepting("w-tls")
    finally:
        await client.delete(worker_key(etcd_settings.prefix, "w-imposter").encode())
        await client.close()
