"""The worker-side merge end to end: two routers batching separately for one real worker under concurrent
load; the worker runs their waiting batches together, so its forwards are larger than the routers'
batches, and every request is still answered OK.

The regime is worker-bound: batches wait at the worker while it runs one, which is when there is anything
to merge. The routers use the timer batcher, which sends a batch whenever one of its slots on the worker
is free. The adaptive batcher holds each batch until just before the worker is expected to be free, so
whether the other router's batch is waiting then is a matter of sub-millisecond timing: 8-14 % of its
batches merged, here and with the CPU limited alike, on either side of the tenth asserted; with the timer
batcher half of them do. The rate is derived from a measurement at the start: a router driven flat out
with a worker that answers at once (tests/support/calibration.py; in-process, so the figure includes the
generator's share of this process) must take the two routers' load with `HEADROOM` to spare; where it
cannot, the test runs time-scaled by `scale_for` (rate divided, the model's time, the deadline and the
run's duration multiplied), the same regime slower.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from sluice_inference.bench.calibration import scale_for
from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn
from tests.support.calibration import router_path_speed

pytestmark = pytest.mark.integration

SLOWDOWN = 4.0
"""The synthetic model at 20 ms + 2 ms/row (at scale 1): a forward runs while both routers' next batches
arrive."""
RATE = 120
"""Requests per second per router at scale 1 (the worker at about 60 % of its capacity)."""
DURATION_S = 4
HEADROOM = 0.4
"""The two routers' load is at most this share of what one router took flat out in the calibration."""


async def wait_serving(router: RouterServer, within_s: float) -> None:
    """Until the router's health reads SERVING (a worker accepts its batches), for at most `within_s`."""
    deadline = time.monotonic() + within_s
    request = health_pb2.HealthCheckRequest(service="")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        probe = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        while (await probe.Check(request, timeout=2)).status != serving:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, f"router never saw the worker within {within_s} s"
            await asyncio.sleep(0.05)


def worker_metrics(port: int) -> dict[str, float]:
    """The worker's sluice_worker_* samples for the synthetic model (and label-free ones), by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model", "synthetic") == "synthetic" and "code" not in s.labels:
                samples[s.name] = s.value
    return samples


async def test_two_routers_batches_run_merged_on_one_worker(make_router: MakeRouter, spawn: Spawn) -> None:
    speed = await router_path_speed(make_router, spawn)
    scale = scale_for(2 * RATE, speed.rps, HEADROOM)
    print(f"calibration: {speed.describe()}; scale {scale:.2f}: {RATE / scale:.0f} req/s per router")
    # Two batches of each router on the worker, as on an accelerator: with a CPU worker's default of one,
    # a router's next batch leaves only once its last came back, and nothing ever waits there to merge.
    timer = RouterSettings(
        listen="127.0.0.1:0", metrics_port=0, batcher="timer", batches_in_flight_per_worker=2
    )
    routers = [await make_router(router=timer), await make_router(router=timer)]
    metrics_port = free_port()
    worker = spawn(
        "merger", slowdown=SLOWDOWN * scale, env={"SLUICE_WORKER__METRICS_PORT": str(metrics_port)}
    )
    for router in routers:
        await wait_serving(router, within_s=60)
    before = await asyncio.to_thread(worker_metrics, metrics_port)
    scenarios = [
        parse_scenario(
            {
                "target": f"127.0.0.1:{router.port}",
                "duration_s": DURATION_S * scale,
                "rate": RATE / scale,
                "seed": seed,
                "channels": 2,
                "classes": [{"name": "load", "model": "synthetic", "deadline_ms": 5000 * scale}],
            }
        )
        for seed, router in enumerate(routers)
    ]
    reports = await asyncio.gather(*(run_scenario(s) for s in scenarios))
    after = await asyncio.to_thread(worker_metrics, metrics_port)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    forwards = delta["sluice_worker_batch_size_count"]
    rows = delta["sluice_worker_batch_size_sum"]
    router_batches = delta["sluice_worker_batches_total"]
    figures = {
        "scale": scale,
        "forwards": forwards,
        "router_batches": router_batches,
        "rows": rows,
        "log": worker.log()[-2000:],
    }
    offered = [s.scheduled for s in scenarios]
    assert [r["total"]["ok"] for r in reports] == offered, (reports, figures)
    assert rows == sum(offered), figures
    # Forwards larger than the routers' batches: at least a tenth of the batches ran merged with another.
    assert forwards <= 0.9 * router_batches, figures
    assert rows / forwards > rows / router_batches, figures
    assert delta.get("sluice_worker_refused_batches_total", 0.0) == 0, figures  # 2 routers x 2 fit in 4
