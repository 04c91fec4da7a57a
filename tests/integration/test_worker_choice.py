"""Worker choice with a worker twice as slow: expected completion sends it proportionally less work and
beats round-robin on p99 (real router, real worker processes, open-loop load)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Literal

import pytest

from bench.loadgen import run_scenario
from bench.loadgen_scenario import parse_scenario
from common.cluster_auth import STATUS_METHOD, ClusterClient
from common.config import RouterSettings
from common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc
from router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

Scheduler = Literal["expected_completion", "least_loaded", "round_robin"]
FAST, SLOW = 6.0, 12.0
"""Slowdowns of the synthetic model (5 ms + 0.5 ms/row): 30 ms + 3 ms/row vs twice that."""


async def executed(router: RouterServer, worker_id: str) -> int:
    addr = router.membership.records[worker_id].addr
    cluster = ClusterClient(router.config.cluster)
    async with cluster.channel(addr, worker_id) as channel:
        metadata = await cluster.authenticate(channel, worker_id, STATUS_METHOD)
        status = await admin_pb2_grpc.WorkerAdminStub(channel).Status(
            admin_pb2.WorkerStatusRequest(), timeout=5, metadata=metadata
        )
    return status.items_executed


async def run(make_router: MakeRouter, spawn: Spawn, scheduler: Scheduler, tag: str) -> dict[str, Any]:
    router = await make_router(
        router=RouterSettings(listen="127.0.0.1:0", metrics_port=0, scheduler=scheduler)
    )
    workers = [spawn(f"fast-{tag}", slowdown=FAST), spawn(f"slow-{tag}", slowdown=SLOW)]
    await eventually(lambda: len(accepting_workers(router)) == 2, 60, "both workers accepted")
    before = {w: await executed(router, w) for w in (f"fast-{tag}", f"slow-{tag}")}
    scenario = parse_scenario(
        {
            "target": f"127.0.0.1:{router.port}",
            "duration_s": 8,
            "rate": 150,
            "seed": 1,
            "channels": 2,
            "classes": [{"name": "load", "model": "synthetic", "deadline_ms": 5000}],
        }
    )
    report = await run_scenario(scenario)
    rows = {w: await executed(router, w) - before[w] for w in before}
    for worker in workers:  # drain, so the next run's router does not see them
        worker.signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)
    await router.stop()
    return {"rows": rows, "p99": report["total"]["latency_ms"]["p99"], "ok": report["total"]["ok"]}


async def test_expected_completion_gives_the_slow_worker_less_and_beats_round_robin(
    make_router: MakeRouter, spawn: Spawn
) -> None:
    smart = await run(make_router, spawn, "expected_completion", "ec")
    naive = await run(make_router, spawn, "round_robin", "rr")
    share = smart["rows"]["slow-ec"] / (smart["rows"]["slow-ec"] + smart["rows"]["fast-ec"])
    naive_share = naive["rows"]["slow-rr"] / (naive["rows"]["slow-rr"] + naive["rows"]["fast-rr"])
    assert share <= 0.36, smart  # at most its speed's share (1/3); it gets less when the fast one keeps up
    assert share < naive_share, (smart, naive)
    assert smart["p99"] < naive["p99"], (smart, naive)
    assert smart["ok"] == naive["ok"] == 1200
