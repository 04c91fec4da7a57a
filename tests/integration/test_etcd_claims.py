"""What etcd holds is a claim, not a credential (docs/design.md §9, 2026-12-01; issue 18).

Anyone who can write etcd can add a `workers/<id>` or `routers/<id>` record pointing at a listener of
theirs. Here that listener records every call's method, metadata and request bytes, and answers identity
challenges with a made-up proof. Real routers, `sluice drain` and `sluice cache stats|purge` must send it
nothing it can replay — no cluster token, no proof, no admin key — while the real cluster keeps working.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sluice_inference.cli.admin_cmds import cache_purge, cache_stats
from sluice_inference.cli.commands import drain
from sluice_inference.common.cluster_auth import PROOF_HEADER
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.dev_certs import write_dev_certs
from sluice_inference.common.etcd import open_client, router_key, worker_key
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter, Spawn
from tests.integration.test_cache_idempotency import synthetic_request
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

CHALLENGE = "/sluice.v1.ClusterIdentity/Challenge"
ADMIN_KEY = "admin-key-of-the-operators-0123456789"


class Recorder(grpc.GenericRpcHandler):
    """The listener a fake record points at: records everything, answers challenges claiming
    `identity` with random bytes for proofs, and refuses every other call after reading it."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self.calls: list[tuple[str, list[tuple[str, str | bytes]]]] = []
        self.payloads: list[bytes] = []

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        """Record the call, then answer it."""
        method = str(handler_call_details.method)
        metadata = [(k, v) for k, v in handler_call_details.invocation_metadata or ()]
        self.calls.append((method, metadata))
        if method == CHALLENGE:
            return grpc.unary_unary_rpc_method_handler(self._answer)
        return grpc.stream_stream_rpc_method_handler(self._swallow)

    async def _answer(self, request: bytes, context: Any) -> bytes:
        self.payloads.append(request)
        fake = worker_pb2.IdentityProof(
            identity=self.identity, nonce=os.urandom(40), token_proofs=[os.urandom(32)]
        )
        return fake.SerializeToString()

    async def _swallow(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                async for request in requests:
                    self.payloads.append(request)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "recorded")
        yield b""  # pragma: no cover - abort raises

    def methods(self) -> set[str]:
        """Every method called on this listener."""
        return {method for method, _ in self.calls}

    def received(self) -> bytes:
        """Every metadata key and value and every request byte this listener got, in one buffer."""
        parts = [*self.payloads]
        for _, metadata in self.calls:
            for key, value in metadata:
                parts += [key.encode(), value if isinstance(value, bytes) else value.encode()]
        return b"\x00".join(parts)


@contextlib.asynccontextmanager
async def recording(identity: str) -> AsyncIterator[tuple[Recorder, str]]:
    """A Recorder serving on a free loopback port, and its address."""
    recorder = Recorder(identity)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((recorder,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield recorder, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def records(etcd: EtcdSettings, values: dict[str, bytes]) -> AsyncIterator[None]:
    """Put `values` (full keys) in etcd, as an attacker with write access would; delete them after."""
    client = await open_client(etcd)
    try:
        for key, value in values.items():
            await client.put(key.encode(), value)
        yield
    finally:
        for key in values:
            await client.delete(key.encode())
        await client.close()


async def test_a_fake_worker_record_gets_nothing_replayable(
    make_router: MakeRouter,
    spawn: Spawn,
    etcd_settings: EtcdSettings,
    cluster_settings: ClusterSettings,
    cluster_token: str,
) -> None:
    spawn("w-real")
    router = await make_router()
    await eventually(lambda: router.driver.core.accepting("w-real"), 60, "w-real accepting")
    real = router.membership.records["w-real"]
    async with recording("workers/w-fake") as (recorder, addr):
        fake = real.model_copy(update={"worker_id": "w-fake", "addr": addr}).to_json()
        async with records(etcd_settings, {worker_key(etcd_settings.prefix, "w-fake"): fake}):
            await eventually(lambda: len(recorder.calls) >= 3, 20, "the router to try the fake three times")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                stub = kserve_grpc.GRPCInferenceServiceStub(channel)
                for value in range(5):
                    reply = await stub.ModelInfer(synthetic_request(float(value)), timeout=10)
                    assert reply.parameters["sluice_worker"].string_param == "w-real"
            assert not router.driver.core.accepting("w-fake")
            # `sluice drain w-fake` with the cluster's token: refused, and nothing sent but a challenge.
            operator = SluiceConfig(etcd=etcd_settings, cluster=cluster_settings)
            assert await drain(operator, "w-fake", 0.0) == 3
    assert recorder.methods() == {CHALLENGE}  # never a stream, never an admin call
    received = recorder.received()
    assert cluster_token.encode() not in received
    assert b"sluice-cluster-token" not in received and PROOF_HEADER.encode() not in received


async def test_a_fake_router_record_gets_no_admin_key(
    make_router: MakeRouter,
    etcd_settings: EtcdSettings,
    cluster_settings: ClusterSettings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = RouterSettings(listen="127.0.0.1:0", metrics_port=0, admin_keys=[hash_api_key(ADMIN_KEY)])
    router = await make_router(router=settings)
    prefix = etcd_settings.prefix
    args = argparse.Namespace(api_key=ADMIN_KEY, tls=False, ca=None, cert=None, key=None, model="synthetic")
    operator = SluiceConfig(etcd=etcd_settings, cluster=cluster_settings)
    async with recording("routers/r-fake") as (recorder, addr):
        planted = {
            router_key(prefix, "r-fake"): json.dumps({"addr": addr}).encode(),
            router_key(prefix, "r-junk"): b"[" * 100_000,
            router_key(prefix, "r-noaddr"): b'{"addr": 8001}',
        }
        async with records(etcd_settings, planted):
            assert await cache_stats(operator, args) == 3
            stats = capsys.readouterr()
            assert await cache_purge(operator, args) == 3
            purged = capsys.readouterr()
            # Without a cluster credential the CLI cannot tell a router from a listener: it sends no key.
            bare = SluiceConfig(etcd=etcd_settings)
            assert await cache_stats(bare, args) == 3
            unchecked = capsys.readouterr()
    assert stats.out.splitlines()[1].startswith(router.router_id)  # the real router answered
    assert f"{router.router_id}: purged" in purged.out
    for err in (stats.err, purged.err):
        assert "r-fake: admin key not sent" in err
        assert "'r-junk': skipped, malformed router record" in err
        assert "'r-noaddr': skipped, malformed router record" in err
        assert "Traceback" not in err
    assert "no cluster credential" in unchecked.err and router.router_id not in unchecked.out
    assert recorder.methods() == {CHALLENGE}
    received = recorder.received()
    assert ADMIN_KEY.encode() not in received and b"authorization" not in received


async def test_under_cluster_mtls_a_router_proves_itself_with_its_certificate(
    make_router: MakeRouter, etcd_settings: EtcdSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dev_certs(tmp_path)
    ca = tmp_path / "ca.pem"
    router_cluster = ClusterSettings(
        ca_file=ca, cert_file=tmp_path / "router-client.pem", key_file=tmp_path / "router-client-key.pem"
    )
    settings = RouterSettings(listen="127.0.0.1:0", metrics_port=0, admin_keys=[hash_api_key(ADMIN_KEY)])
    router = await make_router(router=settings, cluster=router_cluster)
    operator = SluiceConfig(
        etcd=etcd_settings,
        cluster=ClusterSettings(
            ca_file=ca, cert_file=tmp_path / "admin-client.pem", key_file=tmp_path / "admin-client-key.pem"
        ),
    )
    args = argparse.Namespace(api_key=ADMIN_KEY, tls=False, ca=None, cert=None, key=None)
    assert await cache_stats(operator, args) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(router.router_id)
