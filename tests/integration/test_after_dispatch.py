"""Promises that hold after a batch has left the router, with a real worker whose forward pass hangs
(a SIMULATED hung device: `synthetic.hang_trigger`, while the worker's heartbeats carry on).

Before issue 9 the router failed only *queued* requests at their deadline: a dispatched request whose
worker never answered waited for the client to give up, and the hung worker stayed in rotation.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn
from tests.support.processes import eventually
from tests.unit.worker.fakes import synthetic_config, write_model

pytestmark = pytest.mark.integration

HANG = 777.0
LONG_FORWARD_S = 1.5
"""A forward longer than the router's 0.8 s silence bound, so only the worker's reports keep its stream."""
LATE_TOLERANCE_S = 0.5
"""Stated tolerance on when the client sees the router's answer (two shared, noisy cores)."""


def hanging_repository(root: Path, hang_s: float = 600.0) -> Path:
    """The demo-shaped `synthetic` model (1 ms per batch) whose device hangs `hang_s` on a row starting
    with HANG."""
    tensor = {"datatype": "FP32", "dims": [16]}
    config = synthetic_config(
        "synthetic",
        inputs=[{"name": "x", **tensor}],
        outputs=[{"name": "y", **tensor}],
        synthetic={"base_ms": 1.0, "per_item_ms": 0.0, "hang_trigger": HANG, "hang_s": hang_s},
    )
    write_model(root, config)
    return root


def request(value: float, timeout_us: int) -> kserve.ModelInferRequest:
    message = kserve.ModelInferRequest(model_name="synthetic")
    message.inputs.add(name="x", datatype="FP32", shape=[1, 16])
    message.raw_input_contents.append(np.full((1, 16), value, "<f4").tobytes())
    message.parameters["timeout"].int64_param = timeout_us
    return message


async def call(router: RouterServer, message: kserve.ModelInferRequest) -> tuple[str, str, float]:
    """Status name, `sluice-reason` trailer and seconds taken (the client allows 60 s)."""
    start = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        try:
            await kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=60)
        except grpc.aio.AioRpcError as exc:
            reason = dict(exc.trailing_metadata() or ()).get("sluice-reason", "")
            return exc.code().name, str(reason), time.monotonic() - start
    return "OK", "", time.monotonic() - start


async def test_a_dispatched_request_ends_at_its_deadline_when_its_worker_hangs(
    make_router: MakeRouter, spawn: Spawn, tmp_path: Path
) -> None:
    router = await make_router(router=RouterSettings(listen="127.0.0.1:0", metrics_port=0, worker_hang_s=60))
    spawn("w-hang", repository=hanging_repository(tmp_path / "models"))
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    assert (await call(router, request(1.0, 5_000_000)))[0] == "OK"
    status, reason, took = await call(router, request(HANG, 1_500_000))
    assert (status, reason) == (
        "DEADLINE_EXCEEDED",
        "expired_on_worker",
    )  # the router's answer, not the client's
    assert 1.5 <= took < 1.5 + LATE_TOLERANCE_S


async def test_a_worker_whose_forward_hangs_is_treated_as_lost(
    make_router: MakeRouter, spawn: Spawn, tmp_path: Path
) -> None:
    router = await make_router(router=RouterSettings(listen="127.0.0.1:0", metrics_port=0, worker_hang_s=1))
    spawn("w-hang", repository=hanging_repository(tmp_path / "models"))
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    status, reason, took = await call(router, request(HANG, 30_000_000))
    # Lost, re-queued once, then lost again or found no worker while the stream reconnects: UNAVAILABLE with
    # a retry hint, seconds before the 30 s deadline the old router would have waited for.
    assert status == "UNAVAILABLE" and reason in {"worker_lost", "no_worker"}
    assert took < 10


async def test_a_long_forward_on_a_worker_that_was_idle_keeps_its_stream(
    make_router: MakeRouter, spawn: Spawn, tmp_path: Path
) -> None:
    """An idle worker reports once a second, and the router then wants word within 0.8 s of a batch it
    sends: the batch must bring the worker back to its busy pace, or its stream is closed as silent."""
    router = await make_router()
    spawn("w-slow", repository=hanging_repository(tmp_path / "models", hang_s=LONG_FORWARD_S))
    await eventually(lambda: router.driver.core.serves("synthetic", "1"), 60, "the worker to serve")
    link = router.links.get("w-slow")
    assert link is not None
    await eventually(
        lambda: link.last_load is not None and link.last_load.report_interval_ms > 900, 5, "idle reports"
    )
    status, _, took = await call(router, request(HANG, 10_000_000))
    assert status == "OK" and took >= LONG_FORWARD_S
    assert router.links.get("w-slow") is link and not link.closed
