"""One scale-up, end to end: load beyond one worker's capacity raises `desired_workers`; adding the
worker it asks for brings latency back down.

The regime is worker-bound: one worker is what the load exhausts, the router (in this process, with the
generator) keeps headroom. The rate is derived at the start from an in-process router driven flat out
(tests/support/calibration.py): where `RATE` is more than `HEADROOM` of it, the test runs time-scaled by
`scale_for` (rates divided; the workers' slowdown, the deadline and the durations multiplied), the same
loads relative to a worker's capacity, slower."""

from __future__ import annotations

from typing import Any

import pytest

from sluice_inference.bench.calibration import scale_for
from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.common.serving_settings import AutoscaleSettings
from sluice_inference.router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.calibration import router_path_speed
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

SLOWDOWN = 8.0
"""synthetic at 8x (at scale 1): t(b) = 40 ms + 4 ms/row, at most 32 rows: ~190 rows/s per worker flat out."""
RATE = 160
"""Requests per second at scale 1: 84 % of one worker, beyond the 70 % target."""
HEADROOM = 0.4
"""`RATE` is at most this share of what the calibration's router served flat out."""


async def offer(router: RouterServer, rate: float, seconds: float, scale: float) -> dict[str, Any]:
    """`rate` req/s for `seconds` at scale 1, time-scaled by `scale`."""
    load = {
        "target": f"127.0.0.1:{router.port}",
        "duration_s": seconds * scale,
        "rate": rate / scale,
        "seed": 4,
        "classes": [{"name": "load", "model": "synthetic", "deadline_ms": 3000 * scale}],
    }
    return await run_scenario(parse_scenario(load))


async def test_load_raises_desired_workers_and_the_added_worker_relieves_it(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    speed = await router_path_speed(make_router, spawn)
    scale = scale_for(RATE, speed.rps, HEADROOM)
    print(f"calibration: {speed.describe()}; scale {scale:.2f}: {RATE / scale:.0f} req/s")
    router = await make_router(autoscale=AutoscaleSettings(target_utilization=0.7, scale_down_window_s=60))
    spawn("w-1", slowdown=SLOWDOWN * scale)
    await eventually(lambda: accepting_workers(router) == ["w-1"], 60, "first worker")
    await offer(router, 20, 2, scale)
    assert router.status.desired_workers("synthetic") == 1
    alone = await offer(router, RATE, 6, scale)
    desired = router.status.desired_workers("synthetic")
    assert desired >= 2, (scale, desired)
    spawn("w-2", slowdown=SLOWDOWN * scale)
    await eventually(lambda: len(accepting_workers(router)) == 2, 60, "second worker")
    together = await offer(router, RATE, 6, scale)
    assert together["total"]["latency_ms"]["p99"] < alone["total"]["latency_ms"]["p99"]
    assert together["total"]["ok"] == together["scheduled"]
