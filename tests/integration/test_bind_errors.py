"""A server whose address is taken says so in one line and exits 1: gRPC's own error was a RuntimeError
that only pointed at GRPC_VERBOSITY, and `sluice router` or `sluice worker` ended with its traceback. A
start that fails releases what it had taken (the router's side: test_router_stop.py)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from sluice_inference.cli.parsing import EXIT_BAD_ARGS
from sluice_inference.common.config import ClusterSettings, EtcdSettings, SluiceConfig, WorkerSettings
from sluice_inference.common.grpc_server import BindError
from sluice_inference.worker.main import WorkerProcess
from tests.integration.conftest import Spawn

pytestmark = pytest.mark.integration


async def test_a_worker_whose_port_is_taken_names_it_and_exits_1(spawn: Spawn) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        worker = spawn("w-taken", env={"SLUICE_WORKER__LISTEN": address})
        assert worker.wait(60) == EXIT_BAD_ARGS
    log = worker.log()
    assert f"sluice worker: the worker cannot listen on {address}: the address is in use" in log
    assert "Traceback" not in log


async def test_an_in_process_worker_that_cannot_bind_stops_its_device_thread(
    demo_repo: Path, etcd_settings: EtcdSettings, cluster_settings: ClusterSettings
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        worker = WorkerProcess(
            SluiceConfig(
                etcd=etcd_settings,
                cluster=cluster_settings,
                worker=WorkerSettings(repository=demo_repo, models=["synthetic"], listen=address),
            )
        )
        with pytest.raises(BindError, match=f"the worker cannot listen on {address}"):
            await worker.start()
    assert not [thread for thread in threading.enumerate() if thread.name == "device"]
