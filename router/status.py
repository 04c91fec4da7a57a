"""The router's periodic status pass: the watchdog of the decision loop, grpc.health.v1 statuses, queue
and cache gauges, and the autoscaling signal, refreshed every `REFRESH_S` from the policy core's state
while the router has work, every `IDLE_REFRESH_S` while it has none.

Health is SERVING only while the decision loop runs, a worker accepts batches and every etcd watch
(`workers/`, `routers/`, `tenants/`) is being applied: a router whose consumer of `tenants/` keeps failing
would go on honouring revoked keys, so it must leave the Service rather than serve."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from sluice_inference.common.clock import Clock
from sluice_inference.common.errors import Unavailable
from sluice_inference.common.etcd_watch import WatchHealth
from sluice_inference.common.pb.inference import grpc_service_pb2
from sluice_inference.common.serving_settings import AutoscaleSettings
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.cpu_pressure import CpuPressure
from sluice_inference.router.driver import Driver
from sluice_inference.router.host_cost import HostCostFit
from sluice_inference.router.live_stats import LiveStats
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.peers import PeerView
from sluice_inference.router.policy.autoscale import Autoscaler, ModelLoad, ScalingPolicy
from sluice_inference.router.policy.batcher import PRESSED, SATURATED
from sluice_inference.router.policy.budget import ByteBudget
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.policy.door import Door

log = logging.getLogger(__name__)

REFRESH_S = 0.2
"""Between passes while the router has work: the CPU pressure the batcher reads follows a change within
about half a second."""
IDLE_REFRESH_S = 1.0
"""Between passes while it has none: nothing queued, no batch on a worker, and its loop's CPU pressure
under `IDLE_PRESSURE`, seen by a pass that also exported the gauges. Each pass is a wake-up of an
otherwise sleeping process: five a second against one cost an idle router ~0.2 % of a core (1.27-1.33 %
against 1.07-1.13, `bench/idle_cpu.py`, two alternating pairs, 2026-12-02). What this delays comes with
no traffic: health changes (a worker joining or leaving while nothing is sent) show up to this much
later, and the watchdog (`router.watchdog_s`, 5 s) is unaffected. A request brings the next pass
forward (`Driver.arrivals`): waiting out this interval, a burst out of idle ran on one- and two-row
batches until the pressure caught up, up to 1.5 s, and queued calls for 160-320 ms at 1,200 req/s on
one core (docs/performance.md, 2026-12-03). So a trickle of requests a second or more apart gets up to
five passes each (the busy cadence until an exporting pass finds the router idle again)."""
IDLE_PRESSURE = 0.1
"""Below this smoothed CPU pressure (the share of the time the loop runs or waits to run) the loop is
idle for the cadence's purpose: a busy spell decays below it within about four fast passes."""
EXPORT_EVERY_S = 1.0
"""Gauges and `desired_workers` are refreshed this often (health every pass)."""
CORE_STUCK_RETRY_S = 1.0
"""Hint for requests failed by the watchdog: another router (or this one, restarted) can serve them."""
INFERENCE_SERVICE = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PRESSURE_STEP = 0.05
"""CPU pressure is handed to the core in steps this large, and only within `PRESSED`..`SATURATED` (where
the batcher reads it): each new value makes the core decide its waiting lanes afresh."""
NO_HOST_REPORT = (0.0, 0.0, False, PRESSED)
"""What the core holds before any report: no host costs, no constraint, no hold."""


class StatusLoop:
    """Keeps health, gauges and `desired_workers` current; `etcd_connected` answers whether the router's
    own etcd registration is live now (the `etcd_up` gauge)."""

    def __init__(
        self,
        *,
        driver: Driver,
        catalog: ModelCatalog,
        peers: PeerView,
        watches: Sequence[WatchHealth],
        cache: CacheGate,
        live: LiveStats,
        metrics: RouterMetrics,
        inflight_bytes: ByteBudget,
        health: HealthServicer,
        autoscale: AutoscaleSettings,
        etcd_connected: Callable[[], bool],
        clock: Clock,
        pressure: CpuPressure,
        door: Door | None = None,
        cpu_seconds: Callable[[], float] = time.process_time,
    ) -> None:
        self._driver = driver
        self._door = door
        self._cpu_seconds = cpu_seconds
        self._host_fit = HostCostFit()
        self._host_seen = (cpu_seconds(), 0, 0)
        """CPU seconds, batches and rows at the last export (the next interval's start)."""
        self._host_reported = NO_HOST_REPORT
        """(batch_s, row_s, constrained, pressure) as last handed to the core."""
        self.pressure = pressure
        """The event loop's CPU pressure, sampled every pass (on the loop's thread)."""
        self._catalog = catalog
        self._peers = peers
        self._watches = tuple(watches)
        self._exported_at = -math.inf
        self._health_set: dict[str, int] = {}
        """The status last set per health service name."""
        self._exported_watch: dict[str, tuple[bool, int, int]] = {}
        """Each watch's (running, restarts, skipped) as last written to its gauges."""
        self._cache = cache
        self._live = live
        self._metrics = metrics
        self._inflight_bytes = inflight_bytes
        self._health = health
        self._clock = clock
        self.autoscaler = Autoscaler(ScalingPolicy(**autoscale.model_dump()))
        self.desired: dict[str, int] = {}
        self.core_stuck = False
        """Set for good once the watchdog found the decision loop dead or stuck."""
        self._etcd_connected = etcd_connected
        self._task: asyncio.Task[None] | None = None
        self.next_pass_s = REFRESH_S
        """How long after the last pass the next one runs: `REFRESH_S` or, idle, `IDLE_REFRESH_S`."""

    def start(self) -> None:
        """Refresh in the background."""
        self._task = asyncio.create_task(self._run(), name="router-status")

    async def stop(self) -> None:
        """Stop refreshing."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def desired_workers(self, model: str) -> int:
        """The last exported target for `model`."""
        return self.desired.get(model, 0)

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a failing export must not stop health from being kept current
                log.exception("the router's status pass failed")
            if self.next_pass_s < IDLE_REFRESH_S:
                await self._clock.sleep(self.next_pass_s)
            else:  # idle: the next request brings the next pass forward
                arrivals = self._driver.arrivals
                arrivals.clear()
                await arrivals.sleep_until(self._clock.now() + self.next_pass_s)

    async def refresh(self) -> None:
        """One status pass: the watchdog and health every pass; gauges and the autoscaling target at most
        once per `EXPORT_EVERY_S` (scrapes come every few seconds, so five writes a second of every gauge
        were most of an idle router's CPU). Its reads of the core cost a step per model and per
        non-empty lane, never per shape a client ever sent."""
        now = self._clock.now()
        self._watch_core(now)
        self._export_watches()
        await self._set_health()
        pressure = self.pressure.sample()
        exporting = now - self._exported_at >= EXPORT_EVERY_S
        if exporting:
            self._exported_at = now
            self._export_queues(now)
            self._export_cache()
            self._export_desired(now)
            self._fit_host_cost()
            self._metrics.cpu_pressure.set(pressure)
        self._report_host(pressure)
        # Idle only in a pass that exported: the gauges then show the empty queues before the passes slow
        # down, as soon as they did at the fast cadence (a reader waiting for a drained queue's gauge once
        # waited a second longer than before).
        view = self._driver.core.view
        idle = exporting and pressure < IDLE_PRESSURE and not view.queued() and not view.in_flight_batches()
        self.next_pass_s = IDLE_REFRESH_S if idle else REFRESH_S

    def _fit_host_cost(self) -> None:
        """Fit the router's CPU per batch and per row over the last intervals (router/host_cost.py)."""
        cpu = self._cpu_seconds()
        batches, rows = self._driver.core.view.sent()
        last_cpu, last_batches, last_rows = self._host_seen
        self._host_seen = (cpu, batches, rows)
        self._host_fit.add(cpu - last_cpu, batches - last_batches, rows - last_rows)

    def _report_host(self, pressure: float) -> None:
        """Hand the core what its batcher reads of the router's CPU, when that changed: the fitted costs
        with the door's verdict while the router is CPU-bound (and once when it stops being; nothing until
        a fit exists), and the CPU pressure within the band the batcher reads, in `PRESSURE_STEP`s. While
        neither matters the core hears nothing: the batcher behaves as it always did, and an idle router
        makes no extra ticks."""
        estimate = self._host_fit.estimate
        constrained = estimate is not None and self._door is not None and self._door.router_bound()
        batch_s, row_s, _, _ = self._host_reported
        if constrained and estimate is not None:
            batch_s, row_s = estimate.batch_s, estimate.row_s
        band = min(SATURATED, max(PRESSED, round(pressure / PRESSURE_STEP) * PRESSURE_STEP))
        report = (batch_s, row_s, constrained, round(band, 2))
        if report == self._host_reported:
            return
        self._host_reported = report
        self._driver.host_load(batch_s=batch_s, row_s=row_s, constrained=constrained, pressure=report[3])

    def _watch_core(self, now: float) -> None:
        """The watchdog: a decision loop that died or stopped ticking fails what it held, once, and the
        router reports NOT_SERVING from then on so the orchestrator restarts it."""
        if self.core_stuck or self._driver.healthy(now):
            return
        self.core_stuck = True
        log.critical(
            "the router's decision loop has not run for %.1f s or has died: failing every request it "
            "holds and reporting NOT_SERVING",
            now - self._driver.last_tick,
        )
        self._driver.abandon(
            Unavailable(
                "the router's scheduler stopped; retry on another router",
                reason="core_stuck",
                retry_after_s=CORE_STUCK_RETRY_S,
            )
        )

    def _export_watches(self) -> None:
        """Each watch's state into its gauges; only what changed since the last pass is written."""
        for watch in self._watches:
            exported = self._exported_watch.get(watch.name)
            now = (watch.running, watch.restarts, watch.skipped)
            if exported == now:
                continue
            running, restarts, skipped = exported or (None, 0, 0)
            if running != watch.running:
                self._metrics.watch_up.labels(watch.name).set(1 if watch.running else 0)
            if watch.restarts > restarts:
                self._metrics.watch_restarts.labels(watch.name).inc(watch.restarts - restarts)
            if watch.skipped > skipped:
                self._metrics.watch_skipped.labels(watch.name).inc(watch.skipped - skipped)
            self._exported_watch[watch.name] = now

    async def _set_health(self) -> None:
        view = self._driver.core.view
        watching = all(watch.running for watch in self._watches)
        ready = not self.core_stuck and watching and view.any_accepting()
        statuses = {service: SERVING if ready else NOT_SERVING for service in ("", INFERENCE_SERVICE)}
        for name in self._catalog.names():
            model_ready = (
                not self.core_stuck
                and watching
                and any(view.serves(name, v) for v in self._catalog.versions(name))
            )
            statuses[f"model/{name}"] = SERVING if model_ready else NOT_SERVING
        for service, status in statuses.items():
            if self._health_set.get(service) != status:  # watchers are told of changes only
                await self._health.set(service, status)
                self._health_set[service] = status

    def _export_queues(self, now: float) -> None:
        view = self._driver.core.view
        queued = view.queued_by_version(now)  # one step per non-empty lane, not per shape ever seen
        for name in self._catalog.names():
            for version in self._catalog.versions(name):
                held = queued.get((name, version))
                self._metrics.lane_depth.labels(name, version).set(held.depth if held else 0)
                self._metrics.lane_oldest_age.labels(name, version).set(held.oldest_age_s if held else 0.0)
        self._metrics.queued_bytes.set(view.queued_bytes())
        self._metrics.queue_depth.set(view.queued())
        self._metrics.in_flight_batches.set(view.in_flight_batches())
        self._metrics.inflight_bytes.set(self._inflight_bytes.used)
        accepting = view.accepting_count()
        self._metrics.workers.labels("true").set(accepting)
        self._metrics.workers.labels("false").set(view.worker_count() - accepting)
        for tenant, usage in view.tenants(now).items():
            self._metrics.token_level.labels(tenant).set(usage.tokens)
            self._metrics.quota_share.labels(tenant).set(usage.share)

    def _export_cache(self) -> None:
        stats = self._cache.store.stats
        self._metrics.cache_bytes.set(stats.bytes_used)
        self._metrics.cache_evictions.set(stats.evictions)
        self._metrics.redis_up.set(0 if stats.redis_down else 1)
        self._metrics.etcd_up.set(1 if self._etcd_connected() else 0)

    def _export_desired(self, now: float) -> None:
        view = self._driver.core.view
        for name in self._catalog.names():
            record = self._catalog.resolve(name)
            rows_per_s = view.arrival_rate(name, now) * max(1, self._peers.routers)
            ready = view.ready_workers(name)

            def seconds(rows: int, model: str = name, version: str = record.version) -> float:
                return view.batch_seconds(model, version, rows)

            batch = record.max_batch_size
            load = ModelLoad(
                rows_per_s=rows_per_s,
                seconds_per_row=seconds(batch) / batch,
                ready_workers=ready,
                slo_attainment=self._live.window(name, now).slo_attainment,
            )
            self.desired[name] = self.autoscaler.desired(name, load, now)
            self._metrics.desired_workers.labels(name).set(self.desired[name])
