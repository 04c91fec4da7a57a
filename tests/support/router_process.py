"""`sluice router` as a subprocess, for tests that must kill a router the way a crash does (SIGKILL: no
lease revoked, its etcd record lingers until the lease expires)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.trust_settings import EtcdSettings
from tests.support.processes import etcd_env


class RouterProcess:
    """One router process with the given `sluice.yaml` sections, on free ports; `kill()` or `stop()` it."""

    def __init__(
        self, router_id: str, etcd: EtcdSettings, log_dir: Path, config: dict[str, object], token: str
    ) -> None:
        self.router_id = router_id
        self.port = free_port()
        self.log_path = log_dir / f"{router_id}.log"
        config_path = log_dir / f"{router_id}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "sluice_inference.cli", "--config", str(config_path), "router",
                "--router-id", router_id, "--listen", f"127.0.0.1:{self.port}", "--metrics-port",
                "0"]  # fmt: skip
        # Its temporary files (the queue probe's socket folder) under `log_dir`, which pytest removes: a
        # router killed with SIGKILL cannot remove them itself.
        env = {**etcd_env(etcd), "SLUICE_CLUSTER__TOKEN": token, "TMPDIR": str(log_dir)}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def addr(self) -> str:
        """Where clients reach it."""
        return f"127.0.0.1:{self.port}"

    async def serving(self) -> bool:
        """Whether its health service says SERVING (a worker takes its batches)."""
        async with grpc.aio.insecure_channel(self.addr) as channel:
            try:
                stub: Any = health_pb2_grpc.HealthStub(channel)  # types-grpcio-health-checking omits Check
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits for the exit."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def log(self) -> str:
        """What the router printed (for assertion messages)."""
        return self.log_path.read_text(errors="replace")
