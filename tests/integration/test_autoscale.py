"""One scale-up, end to end: load beyond one worker's capacity raises `desired_workers`; adding the
worker it asks for brings latency back down."""

from __future__ import annotations

from typing import Any

import pytest

from bench.loadgen import run_scenario
from bench.loadgen_scenario import parse_scenario
from common.config import AutoscaleSettings
from router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

SLOWDOWN = 8.0
"""synthetic at 8x: t(b) = 40 ms + 4 ms/row, at most 32 rows: ~190 rows/s per worker flat out."""


async def offer(router: RouterServer, rate: float, seconds: float) -> dict[str, Any]:
    load = {
        "target": f"127.0.0.1:{router.port}",
        "duration_s": seconds,
        "rate": rate,
        "seed": 4,
        "classes": [{"name": "load", "model": "synthetic", "deadline_ms": 3000}],
    }
    return await run_scenario(parse_scenario(load))


async def test_load_raises_desired_workers_and_the_added_worker_relieves_it(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    router = await make_router(autoscale=AutoscaleSettings(target_utilization=0.7, scale_down_window_s=60))
    spawn("w-1", slowdown=SLOWDOWN)
    await eventually(lambda: accepting_workers(router) == ["w-1"], 60, "first worker")
    await offer(router, 20, 2)
    assert router.status.desired_workers("synthetic") == 1
    alone = await offer(router, 160, 6)
    desired = router.status.desired_workers("synthetic")
    assert desired >= 2, desired
    spawn("w-2", slowdown=SLOWDOWN)
    await eventually(lambda: len(accepting_workers(router)) == 2, 60, "second worker")
    together = await offer(router, 160, 6)
    assert together["total"]["latency_ms"]["p99"] < alone["total"]["latency_ms"]["p99"]
    assert together["total"]["ok"] == together["scheduled"]
