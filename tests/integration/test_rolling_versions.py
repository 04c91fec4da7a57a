"""Rolling a new model version in under load: workers restarted one by one with v2 added; requests
without a version move to v2 once a v2 worker serves, and not one request fails."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections import Counter
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import eventually

pytestmark = pytest.mark.integration


def with_version_two(demo_repo: Path, root: Path) -> Path:
    shutil.copytree(demo_repo / "synthetic", root / "synthetic")
    (root / "synthetic" / "2").mkdir()
    path = root / "synthetic" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["version_policy"] = {"latest": 2}
    path.write_text(yaml.safe_dump(config))
    return root


async def test_rolling_in_v2_one_worker_at_a_time_fails_no_request(
    make_router: MakeRouter, spawn: Spawn, demo_repo: Path, tmp_path: Path
) -> None:
    rolled = with_version_two(demo_repo, tmp_path / "rolled")
    router = await make_router()
    old = [spawn("w-a"), spawn("w-b")]
    await eventually(lambda: len(accepting_workers(router)) == 2, 60, "v1 workers accepted")
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()

    async def load() -> None:
        request = kserve.ModelInferRequest(model_name="synthetic")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(np.ones((1, 16), "<f4").tobytes())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)

            async def one() -> None:
                try:
                    response = await stub.ModelInfer(request, timeout=10)
                    outcomes[f"v{response.model_version}"] += 1
                except grpc.aio.AioRpcError as exc:
                    outcomes[exc.code().name] += 1

            pending = set()
            while not stop.is_set():
                task = asyncio.create_task(one())
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(0.01)
            await asyncio.gather(*pending)

    def serving(worker_id: str) -> bool:
        return router.driver.core.accepting(worker_id)

    driver = asyncio.create_task(load())
    for worker, replacement in zip(old, ("w-a2", "w-b2"), strict=True):
        await asyncio.sleep(0.5)
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0
        spawn(replacement, repository=rolled)
        await eventually(partial(serving, replacement), 60, replacement)
    await asyncio.sleep(0.5)
    stop.set()
    await driver
    failures = {k: v for k, v in outcomes.items() if not k.startswith("v")}
    assert failures == {}, outcomes
    assert outcomes["v1"] > 0 and outcomes["v2"] > 0
