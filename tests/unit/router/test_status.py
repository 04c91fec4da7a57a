"""The router's status pass beside the driver: it hands the core the router's CPU per batch and row and its
CPU pressure, slows to an idle cadence only while there is no work, wakes for the next request, and turns
health NOT_SERVING when the decision loop dies or an etcd watch stops being applied."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from sluice_inference.common.clock import Clock, FakeClock, MonotonicClock
from sluice_inference.common.errors import Code
from sluice_inference.common.etcd_watch import WatchHealth
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.serving_settings import AutoscaleSettings, CacheSettings
from sluice_inference.common.trust_settings import EtcdSettings
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.cpu_pressure import CpuPressure
from sluice_inference.router.driver import Driver
from sluice_inference.router.live_stats import LiveStats
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.peers import PeerView
from sluice_inference.router.policy.batcher import (
    NO_HOST_COST,
    PRESSED,
    SATURATED,
    BatchContext,
    Cut,
    WakeAt,
)
from sluice_inference.router.policy.budget import ByteBudget
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.policy.door import Door
from sluice_inference.router.policy.lanes import Lane
from sluice_inference.router.status import EXPORT_EVERY_S, IDLE_REFRESH_S, REFRESH_S, StatusLoop
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.router.worker_link import WorkerLinks
from tests.support.processes import eventually
from tests.unit.router.driver_support import TENANT, FakeLink, infer, join, make_driver


@pytest.fixture
async def links() -> AsyncIterator[WorkerLinks]:
    yield WorkerLinks()


class _Fatal(BaseException):
    """Escapes every `except Exception`: what kills a task outright."""


class _DeadlyBatcher:
    """Asks to be woken at `at`, and then kills whatever called it (only the loop ticks then)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        if ctx.now >= self.at:
            raise _Fatal
        return WakeAt(self.at, lane.limits.max_batch_size)


def status_loop(
    driver: Driver,
    health: HealthServicer,
    clock: Clock,
    watches: tuple[WatchHealth, ...] = (),
    *,
    door: Door | None = None,
    cpu_seconds: Callable[[], float] = time.process_time,
    pressure: CpuPressure | None = None,
) -> StatusLoop:
    """The router's status pass over `driver`, with no etcd behind it (and, unless `pressure` says
    otherwise, a loop that never wants the CPU: the real one would make the batcher hold in a busy test
    run)."""
    metrics = RouterMetrics()
    tenants = {TENANT.name: TENANT.settings}
    store = ResultCacheStore(capacity_bytes=1024, ttl_s=1.0, clock=clock)
    return StatusLoop(
        driver=driver,
        catalog=ModelCatalog(),
        peers=PeerView(
            EtcdSettings(), tenants, require_api_key=False, driver=driver, metrics=metrics, clock=clock
        ),
        watches=watches,
        cache=CacheGate(store, CacheSettings(), metrics),
        live=LiveStats(),
        metrics=metrics,
        inflight_bytes=ByteBudget(1024 * 1024),
        health=health,
        autoscale=AutoscaleSettings(),
        etcd_connected=lambda: False,
        clock=clock,
        door=door,
        cpu_seconds=cpu_seconds,
        pressure=pressure or CpuPressure(clock.now, lambda: (0.0, 0.0)),
    )


async def test_the_status_pass_hands_the_core_the_routers_cpu_per_batch_and_row_while_the_door_sees_it_short(
    links: WorkerLinks,
) -> None:
    """The status pass fits the router's CPU against the batches and rows it cut (router/host_cost.py) and
    tells the core, with the door's verdict. Here the "CPU" is what a known cost per batch and per row
    would have spent on the batches really cut, so the fit must find those costs exactly."""
    per_batch, per_row = 0.0004, 0.0001
    driver = make_driver(links)
    links.add(FakeLink("w1", driver))
    join(driver, "w1")
    status_clock = FakeClock(1000.0)
    door = Door(max_delay_s=0.02)
    cpu = [0.0]
    status = status_loop(driver, HealthServicer(), status_clock, door=door, cpu_seconds=lambda: cpu[0])
    driver.start()
    try:
        door.observe(0.015, 0.0)  # calls wait 15 ms for the router's code: past half the 20 ms bound
        for concurrent in (1, 8, 1, 8, 3):
            before = driver.core.view.sent()
            await asyncio.gather(*(infer(driver) for _ in range(concurrent)))
            await asyncio.gather(*(infer(driver) for _ in range(concurrent)))
            batches, rows = (now - then for now, then in zip(driver.core.view.sent(), before, strict=True))
            cpu[0] += per_batch * batches + per_row * rows
            status_clock.advance(1.0)
            await status.refresh()
        host = driver.core.planner.host
        assert host.constrained
        assert host.batch_s == pytest.approx(per_batch, rel=1e-6)
        assert host.row_s == pytest.approx(per_row, rel=1e-6)
        door.observe(0.001, 1.0)  # the queue drained: the router's CPU is no longer the constraint
        status_clock.advance(1.0)
        await status.refresh()
        assert not driver.core.planner.host.constrained
    finally:
        await driver.stop()


async def test_the_status_pass_hands_the_core_its_cpu_pressure_only_within_the_band_the_batcher_reads(
    links: WorkerLinks,
) -> None:
    """The loop's pressure reaches the core's batcher in steps, only from `PRESSED` up (below it the core
    hears nothing: an idle router makes no extra ticks), and falls back to no hold when the load goes."""
    driver = make_driver(links)
    status_clock = FakeClock(1000.0)
    busy = [0.0]
    share = [0.0]

    def times() -> tuple[float, float]:  # the loop wanted the CPU `share` of each 0.2 s pass
        busy[0] += share[0] * 0.2
        return busy[0], 0.0

    pressure = CpuPressure(status_clock.now, times)
    status = status_loop(driver, HealthServicer(), status_clock, pressure=pressure)
    reports: list[float] = []
    original = driver.host_load

    def recording(**kwargs: Any) -> None:
        reports.append(kwargs["pressure"])
        original(**kwargs)

    driver.host_load = recording  # type: ignore[method-assign]

    async def passes(level: float, count: int) -> None:
        share[0] = level
        for _ in range(count):
            status_clock.advance(0.2)
            await status.refresh()

    await passes(0.3, 10)  # a lightly loaded loop: nothing handed over
    assert reports == [] and driver.core.planner.host == NO_HOST_COST
    await passes(0.8, 10)  # the smoothed pressure climbs to 0.8 in steps of 0.05
    assert driver.core.planner.host.pressure == pytest.approx(0.8)
    assert reports == sorted(reports) and len(reports) == len(set(reports)) <= 7
    await passes(1.0, 10)  # past `SATURATED` it is held at the top of the band
    assert driver.core.planner.host.pressure == pytest.approx(SATURATED)
    await passes(0.1, 10)  # the load went: back to the bottom of the band, where nothing is held
    assert driver.core.planner.host.pressure == pytest.approx(PRESSED)
    assert driver.core.planner.host.hold_s(0.005) == 0.0


async def test_the_status_pass_slows_to_its_idle_cadence_only_while_the_router_has_no_work(
    links: WorkerLinks,
) -> None:
    """Every `REFRESH_S` while a request is held or the loop is busy, every `IDLE_REFRESH_S` once nothing is
    held and the loop's pressure has decayed below `IDLE_PRESSURE`: an idle router wakes once a second."""
    driver = make_driver(links)
    silent = FakeLink("w1")  # takes batches and never answers: they stay on the worker
    links.add(silent)
    join(driver, "w1")
    status_clock = FakeClock(1000.0)
    busy = [0.0]
    share = [0.0]
    interval = [REFRESH_S]

    def times() -> tuple[float, float]:  # the loop wanted the CPU `share` of each pass
        busy[0] += share[0] * interval[0]
        return busy[0], 0.0

    pressure = CpuPressure(status_clock.now, times)
    status = status_loop(driver, HealthServicer(), status_clock, pressure=pressure)

    async def next_pass() -> float:
        interval[0] = status.next_pass_s
        status_clock.advance(interval[0])
        await status.refresh()
        return status.next_pass_s

    async def idle_within(passes: int) -> bool:
        cadence = [await next_pass() for _ in range(passes)]
        return cadence[-1] == IDLE_REFRESH_S and cadence == sorted(cadence)

    assert [await next_pass() for _ in range(2)] == [IDLE_REFRESH_S] * 2  # nothing held, nothing running
    driver.start()
    held = asyncio.ensure_future(infer(driver))
    try:
        await eventually(lambda: driver.core.view.in_flight_batches() == 1, 2.0, "a batch on w1")
        assert await next_pass() == REFRESH_S  # a batch on a worker
        batch = silent.sent[-1].batches[0]
        driver.on_message("w1", worker_pb2.WorkerMessage(results=[silent._answer(batch)]))
        assert await held == Code.OK
        # Idle again at the first pass that also exports the gauges (at most a second after the last).
        assert await idle_within(round(EXPORT_EVERY_S / REFRESH_S))
        share[0] = 0.8  # the loop is busy with something the core does not hold (answers from the cache)
        assert await next_pass() == REFRESH_S
        share[0] = 0.0
        assert await next_pass() == REFRESH_S  # the pressure decays over a few passes
        assert await idle_within(round(EXPORT_EVERY_S / REFRESH_S))
    finally:
        held.cancel()
        await driver.stop()


async def test_an_idle_status_pass_is_brought_forward_by_the_next_request(links: WorkerLinks) -> None:
    """An idle router's next pass is up to `IDLE_REFRESH_S` away, but a request brings it forward at once:
    the CPU pressure the batcher holds on is sampled with a burst, not a second into it."""
    clock = FakeClock(1000.0)  # the driver's and the status pass's, as in a router: it never moves here
    driver = make_driver(links, clock=clock)
    links.add(FakeLink("w1"))  # takes batches and never answers: the request stays held
    join(driver, "w1")
    status = status_loop(driver, HealthServicer(), clock)
    passes = [0]
    refresh = status.refresh

    async def counted() -> None:
        passes[0] += 1
        await refresh()

    status.refresh = counted  # type: ignore[method-assign]
    driver.start()
    status.start()
    held = None
    try:
        await eventually(lambda: passes[0] == 1 and status.next_pass_s == IDLE_REFRESH_S, 2.0, "an idle pass")
        for _ in range(20):  # turns of the loop, not time: the clock stands still
            await asyncio.sleep(0)
        assert passes[0] == 1  # asleep until the clock moves or a request comes
        held = asyncio.ensure_future(infer(driver))
        await eventually(lambda: passes[0] == 2, 2.0, "a pass brought forward by the request")
        assert status.next_pass_s == REFRESH_S  # a batch on a worker: the busy cadence
    finally:
        if held is not None:
            held.cancel()
        await status.stop()
        await driver.stop()


async def overall_health(health: HealthServicer) -> int:
    check = await health.Check(health_pb2.HealthCheckRequest(service=""), None)  # type: ignore[arg-type]
    return int(check.status)


async def test_the_watchdog_fails_what_a_dead_loop_held_and_turns_health_not_serving(
    links: WorkerLinks,
) -> None:
    clock = MonotonicClock()
    driver = make_driver(links, batcher=_DeadlyBatcher(clock.now() + 0.2))
    links.add(FakeLink("w1", driver))
    join(driver, "w1")
    health = HealthServicer()
    status = status_loop(driver, health, clock)
    driver.start()
    status.start()
    try:
        assert await infer(driver) == Code.UNAVAILABLE  # failed by the watchdog, not left hanging
        assert status.core_stuck and not driver.healthy(clock.now())
        assert await overall_health(health) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await status.stop()
        await driver.stop()


async def test_an_etcd_watch_not_being_applied_turns_health_not_serving_until_it_is_again(
    links: WorkerLinks,
) -> None:
    """A router whose `tenants/` consumer keeps failing would honour revoked keys: it must not serve."""
    clock = MonotonicClock()
    driver = make_driver(links)
    links.add(FakeLink("w1", driver))
    join(driver, "w1")
    health = HealthServicer()
    tenants = WatchHealth("tenants", running=True)
    status = status_loop(driver, health, clock, (WatchHealth("workers", running=True), tenants))
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    driver.start()
    status.start()
    try:
        await eventually_async(lambda: overall_health(health), serving)
        tenants.running = False
        await eventually_async(lambda: overall_health(health), not_serving)
        tenants.running = True
        await eventually_async(lambda: overall_health(health), serving)
    finally:
        await status.stop()
        await driver.stop()


async def eventually_async(read: Callable[[], Awaitable[int]], expected: int, within_s: float = 5.0) -> None:
    """Until `read()` returns `expected`, for at most `within_s` (the status pass runs every 0.2 s)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while (value := await read()) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"still {value}, expected {expected}"
        await asyncio.sleep(0.05)
