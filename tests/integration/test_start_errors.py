"""What stops a server at start is said in one line, with an exit status a supervisor can tell apart: an
address that is taken (exit 1: gRPC's own error was a RuntimeError that only pointed at GRPC_VERBOSITY)
or an etcd that does not answer (exit 2), where `sluice router` and `sluice worker` ended with a
traceback. A start that fails releases what it had taken (the router's side: test_router_stop.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sluice_inference.cli.commands import EXIT_CONNECTION
from sluice_inference.cli.parsing import EXIT_BAD_ARGS
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.grpc_server import BindError
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.serving_settings import WorkerSettings
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings
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


def test_a_router_that_cannot_reach_etcd_says_so_and_exits_2() -> None:
    silent = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "SLUICE_ETCD__ENDPOINTS": f'["{silent}"]'}
    done = subprocess.run(
        [sys.executable, "-m", "sluice_inference.cli", "router", "--listen", "127.0.0.1:0"],
        check=False, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == EXIT_CONNECTION, done.stderr
    assert f"sluice router: cannot register in etcd: no etcd endpoint answered: {silent}" in done.stderr
    assert "Traceback" not in done.stderr
