"""A keyed router refuses key-less bodies before reading them: 16 concurrent 60 MB `ModelInfer` calls
without an API key end UNAUTHENTICATED while the router's peak RSS grows by less than `RSS_BOUND`.

Before the gate (router/auth.py, common/grpc_gate.py) each body was read whole before the key was checked:
the same load took a router from ~100 MB to ~1.4 GB. The router runs as its own process (`sluice router`),
so its VmHWM (peak resident set) measures only the router.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.policy.tenants import hash_api_key
from tests.support.processes import etcd_env, wait_until

pytestmark = pytest.mark.integration

BODY_BYTES = 60 * 1024 * 1024
CONCURRENT = 16
RSS_BOUND = 300 * 1024 * 1024
"""Growth allowed for the router's peak RSS. The bodies are never handed to Python, but gRPC's transport
takes in what each stream's flow-control window lets the client send before the refusal lands (measured:
50-110 MB for all sixteen together, varying with the window gRPC's bandwidth probe had grown to); read
whole, they took 1,600 MB."""


def peak_rss(pid: int) -> int:
    """VmHWM of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def answers(addr: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
        except grpc.FutureTimeoutError:
            return False
    return True


@pytest.fixture
def keyed_router(
    etcd_settings: EtcdSettings, cluster_token: str, tmp_path: Path
) -> Iterator[tuple[str, int]]:
    """`sluice router` with one keyed tenant and no anonymous one; its address and pid."""
    config = tmp_path / "sluice.yaml"
    config.write_text(yaml.safe_dump({"tenants": {"gold": {"api_keys": [hash_api_key("gold-key")]}}}))
    port = free_port()
    argv = [sys.executable, "-m", "sluice_inference.cli", "--config", str(config), "router", "--listen",
            f"127.0.0.1:{port}", "--metrics-port", "0"]  # fmt: skip
    # Killed with SIGKILL at the end: its probe folder goes with tmp_path (tests/support/router_process.py).
    env = {**etcd_env(etcd_settings), "SLUICE_CLUSTER__TOKEN": cluster_token, "TMPDIR": str(tmp_path)}
    with (tmp_path / "router.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        addr = f"127.0.0.1:{port}"
        wait_until(lambda: answers(addr) or process.poll() is not None, 60, "the router to listen")
        assert process.poll() is None, (tmp_path / "router.log").read_text()
        yield addr, process.pid
    finally:
        process.kill()
        process.wait(10)


async def test_key_less_60_mb_bodies_are_refused_unread(keyed_router: tuple[str, int]) -> None:
    addr, pid = keyed_router
    request = kserve.ModelInferRequest(model_name="synthetic")
    request.inputs.add(name="x", datatype="FP32", shape=[BODY_BYTES // 64, 16])
    request.raw_input_contents.append(bytes(BODY_BYTES))
    body = request.SerializeToString()  # once: every call sends these same bytes
    before = peak_rss(pid)
    options = [("grpc.max_send_message_length", 2 * BODY_BYTES)]
    async with grpc.aio.insecure_channel(addr, options=options) as channel:
        infer: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer"
        )

        async def one() -> grpc.StatusCode:
            try:
                await infer(body, timeout=60)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        codes = await asyncio.gather(*(one() for _ in range(CONCURRENT)))
    grown = peak_rss(pid) - before
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CONCURRENT
    assert grown < RSS_BOUND, f"router peak RSS grew by {grown / 2**20:.0f} MB"
