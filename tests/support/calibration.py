"""The router path's speed for integration tests whose routers run in the test's own process.

A load-shaped integration test derives its rates from this measurement (bench/calibration.py says why and
how). A router of its own and a worker whose synthetic model answers at once are started, the router is
driven flat out by a closed loop from this process, and both are stopped before the test starts its own,
so nothing the calibration taught a router (estimates, peers, shares) reaches the test. The router's CPU
is this process's, so the figure includes the generator's share of it, as the test's own load will.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

from sluice_inference.bench.calibration import RouterSpeed, measure_router, one_row_request
from sluice_inference.router.main import RouterServer
from tests.support.processes import WorkerProcess, eventually

INSTANT = 1e-3
"""The calibration worker's slowdown: the demo synthetic model (5 ms + 0.5 ms/row) in microseconds."""
WORKER_ID = "calibration-instant"


async def router_path_speed(
    make_router: Callable[..., Awaitable[RouterServer]], spawn: Callable[..., WorkerProcess]
) -> RouterSpeed:
    """What an in-process router serves flat out here and now (see the module docstring)."""
    router = await make_router()
    worker = spawn(WORKER_ID, slowdown=INSTANT)
    try:
        await eventually(lambda: router.driver.core.accepting(WORKER_ID), 60, "the calibration worker")
        target = f"127.0.0.1:{router.port}"
        return await measure_router(target, one_row_request("synthetic"), router_pid=os.getpid())
    finally:
        worker.signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 30)
        await router.stop()
