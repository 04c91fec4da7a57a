"""`sluice router --processes 2`: two router processes serve one port (each registered in etcd), requests
over separate connections are all answered, a child that dies is started again while the other keeps
serving, and SIGTERM to the parent stops every child."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sluice_inference.common.etcd import ROUTERS, open_client
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.trust_settings import EtcdSettings
from tests.integration.conftest import Spawn
from tests.integration.test_hostile_clients import synthetic_request
from tests.support.processes import etcd_env, eventually, find_pids

pytestmark = pytest.mark.integration

Popen = subprocess.Popen[bytes]
OK = grpc.StatusCode.OK
STARTUP_POLLS = 600
"""Up to a minute, 0.1 s apart, for both children to register and the worker to serve."""


async def registered_routers(settings: EtcdSettings) -> set[str]:
    client = await open_client(settings)
    try:
        found = await client.get_prefix((settings.prefix + ROUTERS).encode())
    finally:
        await client.close()
    return {kv.key.decode().rsplit("/", 1)[-1] for kv in found}


@pytest.fixture
def routers(etcd_settings: EtcdSettings, cluster_token: str, tmp_path: Path) -> Iterator[tuple[int, Popen]]:
    port = free_port()
    argv = [sys.executable, "-m", "sluice_inference.cli", "router", "--processes", "2", "--listen",
            f"127.0.0.1:{port}", "--metrics-port", "0", "--router-id", f"r{port}"]  # fmt: skip
    # The children's probe folders under tmp_path: the test kills one with SIGKILL (router_process.py).
    env = {**etcd_env(etcd_settings), "SLUICE_CLUSTER__TOKEN": cluster_token, "TMPDIR": str(tmp_path)}
    with (tmp_path / "routers.log").open("wb") as log:
        parent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield port, parent
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for pid in find_pids("-m sluice_inference.cli router", f"--router-id r{port}"):
            os.kill(pid, signal.SIGKILL)


def exited(pid: int) -> bool:
    """Whether every thread of the process has exited (what is left is a zombie its parent has not reaped
    yet): only then are its files, the listening socket among them, closed, so the kernel no longer hands
    it new connections. The main thread turns zombie while gRPC's threads are still exiting."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # reaped
    try:
        states = [
            Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks
        ]
    except FileNotFoundError:
        return False  # a thread left while we looked: look again
    return all(state in ("Z", "X") for state in states)


async def answered(port: int, connections: int) -> list[grpc.StatusCode]:
    """One ModelInfer on each of `connections` separate connections (a local subchannel pool: gRPC would
    otherwise share one connection among channels to the same address)."""

    async def one() -> grpc.StatusCode:
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            try:
                await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    synthetic_request(), timeout=10
                )
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

    return list(await asyncio.gather(*(one() for _ in range(connections))))


async def test_two_processes_serve_one_port_restart_a_dead_child_and_stop_together(
    routers: tuple[int, Popen], spawn: Spawn, etcd_settings: EtcdSettings
) -> None:
    port, parent = routers
    spawn("w1")
    ids = {f"r{port}-0", f"r{port}-1"}
    for _ in range(STARTUP_POLLS):
        if await registered_routers(etcd_settings) == ids and await answered(port, 8) == [OK] * 8:
            break
        await asyncio.sleep(0.1)
    assert await registered_routers(etcd_settings) == ids  # one registration per process
    assert await answered(port, 16) == [OK] * 16

    [first] = find_pids("-m sluice_inference.cli router", f"--router-id r{port}-0")
    os.kill(first, signal.SIGKILL)
    # a connection the kernel handed to the dying child before it exited fails (UNAVAILABLE, retryable)
    await eventually(lambda: exited(first), 10, "the killed child to exit")
    assert await answered(port, 8) == [OK] * 8  # the other child serves meanwhile
    await eventually(
        lambda: find_pids("-m sluice_inference.cli router", f"--router-id r{port}-0") not in ([], [first]),
        30,
        "the dead child to be started again",
    )

    parent.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(parent.wait, 40) == 0
    assert find_pids("-m sluice_inference.cli router", f"--router-id r{port}") == []
