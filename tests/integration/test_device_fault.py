"""A device fault takes its worker out: the batch that met it is answered (INTERNAL), the worker turns
NOT_SERVING and DRAINING, its etcd key goes at once, routers see its stream close, and the process exits
with EXIT_DEVICE_FAULT for its supervisor to restart it. Simulated on a CPU by the synthetic backend's
test-only `fault_trigger` (a sticky "CUDA error: device-side assert triggered")."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest

from sluice_inference.cli.commands import EXIT_NOT_SERVING, health
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.etcd import worker_key
from sluice_inference.common.exit_codes import EXIT_DEVICE_FAULT
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.serving_settings import WorkerSettings
from sluice_inference.common.trust_settings import ClusterSettings, EtcdSettings
from sluice_inference.worker.main import WorkerProcess
from tests.integration.conftest import MakeRouter, Spawn
from tests.integration.test_etcd import read_key
from tests.integration.test_failures import call, request
from tests.support.processes import eventually
from tests.unit.worker.fakes import synthetic_config, write_model

pytestmark = pytest.mark.integration

TRIGGER = 666.0


def faulty_repository(root: Path) -> Path:
    """A SIMULATED model (1 ms per batch) whose device breaks on a row starting with TRIGGER; named and
    shaped like the demo `synthetic` model (x, y: FP32 [16]) so test_failures' request helpers apply."""
    tensor = {"datatype": "FP32", "dims": [16]}
    config = synthetic_config(
        "synthetic",
        inputs=[{"name": "x", **tensor}],
        outputs=[{"name": "y", **tensor}],
        synthetic={"base_ms": 1.0, "per_item_ms": 0.0, "fault_trigger": TRIGGER},
    )
    write_model(root, config)
    return root


async def test_a_faulted_worker_process_leaves_etcd_and_exits_to_be_restarted(
    make_router: MakeRouter, spawn: Spawn, etcd_settings: EtcdSettings, tmp_path: Path
) -> None:
    router = await make_router()
    worker = spawn("w-fault", models="synthetic", repository=faulty_repository(tmp_path / "models"))
    await eventually(lambda: router.driver.core.accepting("w-fault"), 60, "worker accepted")
    assert isinstance(await call(router, request(1.0)), kserve.ModelInferResponse)
    assert await call(router, request(TRIGGER)) == grpc.StatusCode.INTERNAL
    code = await asyncio.to_thread(worker.wait, 30)
    assert code == EXIT_DEVICE_FAULT, worker.log()
    # Revoked, not expired: the lease (TTL 2 s, refreshed every ~0.67 s) would outlive the process by
    # more than a second, and the key is read the moment the process is gone.
    assert await read_key(etcd_settings, worker_key(etcd_settings.prefix, "w-fault")) is None
    await eventually(lambda: "w-fault" not in router.links, 5, "the router's stream to w-fault closed")
    assert "device fault" in worker.log()


async def test_a_faulted_worker_is_not_serving_and_draining_everywhere(
    make_router: MakeRouter, etcd_settings: EtcdSettings, cluster_settings: ClusterSettings, tmp_path: Path
) -> None:
    """In-process, so the state between the fault and the exit can be looked at."""
    router = await make_router()
    settings = WorkerSettings(
        repository=faulty_repository(tmp_path / "models"), models=["synthetic"], worker_id="w-inproc"
    )
    worker = WorkerProcess(SluiceConfig(etcd=etcd_settings, worker=settings, cluster=cluster_settings))
    await worker.start()
    try:
        await eventually(lambda: router.driver.core.accepting("w-inproc"), 30, "worker accepted")
        assert await call(router, request(TRIGGER)) == grpc.StatusCode.INTERNAL
        await asyncio.wait_for(worker.faulted.wait(), 10)
        assert worker.state.state == worker_pb2.WORKER_STATE_DRAINING
        # The probe Kubernetes runs (`sluice health`): 4 means reachable but not SERVING.
        probe = argparse.Namespace(addr=worker.addr, service="", timeout=5.0, tls=False, ca=None, cert=None)
        assert await asyncio.to_thread(health, probe) == EXIT_NOT_SERVING
        assert await read_key(etcd_settings, worker_key(etcd_settings.prefix, "w-inproc")) is None
        await eventually(lambda: not router.driver.core.accepting("w-inproc"), 5, "no more batches for it")
        assert worker.executor.fault is not None
        await asyncio.wait_for(worker.drain(), 1)  # a SIGTERM now finds nothing to drain, and no error
        assert not worker.drained.is_set()
    finally:
        await worker.stop(grace=0.1)
