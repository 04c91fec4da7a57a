"""Router process assembly: gRPC server (KServe v2, admin, health, reflection), metrics, etcd.

`RouterServer.start()` returns once the server is bound and serving (it never blocks for the process's
lifetime), so tests and `sluice up` can run routers in-process; `serve_router` is the blocking entry point
used by `sluice router`, stopping cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from sluice_inference.common import compiled_core
from sluice_inference.common.clock import Clock, MonotonicClock, wait_until
from sluice_inference.common.cluster_auth import ClusterClient, router_identity, router_identity_servicer
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.etcd import LeasedKey, router_key
from sluice_inference.common.event_loop import running_loop_name
from sluice_inference.common.grpc_server import keepalive_options, listen
from sluice_inference.common.heap import settle_after_startup
from sluice_inference.common.metrics import MetricsEndpoint, listen_host
from sluice_inference.common.pb.inference import grpc_service_pb2
from sluice_inference.common.pb.sluice.v1 import admin_pb2, worker_pb2, worker_pb2_grpc
from sluice_inference.common.telemetry import provider_from_environment, tracer
from sluice_inference.common.tls import server_credentials
from sluice_inference.router.auditor import CacheAuditor
from sluice_inference.router.auth import AccessPolicy, TenantKeys
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.cpu_pressure import CpuPressure
from sluice_inference.router.dataplane import DataPlane, DriverBackend
from sluice_inference.router.driver import Driver
from sluice_inference.router.edge import FrontDoor, GenericOnly, MalformedBodies, add_service
from sluice_inference.router.idempotency_gate import IdempotencyGate
from sluice_inference.router.live_stats import LiveStats
from sluice_inference.router.membership import Membership
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.peers import PeerView, router_record
from sluice_inference.router.policy.budget import ByteBudget
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.door import Door
from sluice_inference.router.queue_probe import QueueProbe
from sluice_inference.router.receive_gate import GatedServer, ReceiveGate
from sluice_inference.router.servicer import InferenceServicer, RouterAdminServicer
from sluice_inference.router.status import INFERENCE_SERVICE, StatusLoop
from sluice_inference.router.stores.from_config import cache_store, idempotency_store, redis_options
from sluice_inference.router.stores.redis_conn import open_redis
from sluice_inference.router.worker_link import WorkerLinks

log = logging.getLogger(__name__)
STOP_STEP_S = 5.0
"""The longest one step of `RouterServer.stop` may take (the server's own grace comes on top)."""

INFERENCE_DESCRIPTOR = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
BATCH_OVERHEAD_BYTES = 64 * 1024
"""Room kept in a worker-stream message for the batch's own framing (ids, names, trace context)."""

# grpc-core cancels RPCs beyond 1,000 waiting for the Python handler (3,000 hard); raise the bounds so a
# burst reaches admission control, which refuses it explicitly and cheaply with a retry hint.
SERVER_QUEUE_OPTIONS = [
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 40_000),
]
SERVER_KEEPALIVE_OPTIONS = keepalive_options(min_ping_interval_ms=500)


class RouterServer:
    """One router: start, serve, stop."""

    def __init__(
        self, config: SluiceConfig, clock: Clock | None = None, tracer_provider: TracerProvider | None = None
    ) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        settings = config.router
        self.router_id = settings.router_id  # default chosen at start, once the port is known
        self.metrics = RouterMetrics(config.admission.priority_levels)
        self.links = WorkerLinks()
        self.catalog = ModelCatalog()
        self.live = LiveStats()
        self.tracer_provider = tracer_provider or provider_from_environment("sluice-router")
        core = RouterCore(
            self.clock.now(),
            settings=settings,
            admission=config.admission,
            tenants=config.tenants,
            max_batch_bytes=config.cluster.max_message_bytes - BATCH_OVERHEAD_BYTES,
        )
        self.driver = Driver(
            self.clock,
            core,
            self.links,
            self.metrics,
            tracer=None if self.tracer_provider is None else tracer(self.tracer_provider, "sluice.router"),
        )
        self.peers = PeerView(
            config.etcd,
            config.tenants,
            require_api_key=config.admission.require_api_key,
            driver=self.driver,
            metrics=self.metrics,
            clock=self.clock,
        )
        cluster = ClusterClient(config.cluster, caller=lambda: router_identity(self.router_id or "starting"))
        if not config.cluster.tls and config.cluster.token_value() is None:
            log.warning("no cluster.token and no cluster mTLS: workers will refuse this router's streams")
        self.membership = Membership(
            config.etcd, self.driver, self.links, self.catalog, cluster=cluster, clock=self.clock
        )
        self.keys = TenantKeys(self.peers.current_directory)
        """API key → tenant, remembered per key: the gate, the front door and the data plane share it."""
        self.access = AccessPolicy(
            self.keys,
            admin_keys=settings.admin_keys,
            require_api_key=config.admission.require_api_key,
        )
        self.redis = open_redis(redis_options(config)) if config.redis.url else None
        self.cache = CacheGate(
            cache_store(config, self.redis, self.clock, self.metrics), config.cache, self.metrics
        )
        self.idempotency = IdempotencyGate(
            idempotency_store(config, self.redis, self.clock, self.metrics),
            config.idempotency,
            self.clock,
            self.metrics,
        )
        backend = DriverBackend(self.driver)
        self.auditor = CacheAuditor(
            backend, self.cache, settings=config.cache, metrics=self.metrics, clock=self.clock
        )
        self.health = HealthServicer()
        self.malformed = MalformedBodies(self.clock)
        self.door = Door(settings.door_max_delay_ms / 1000, settings.door_sustain_s)
        self.queue_probe = QueueProbe(self.door, self.metrics, self.clock)
        self.receives = ReceiveGate(
            self.keys,
            self.metrics,
            check=self.access.check_call,
            probe_token=self.queue_probe.token,
            max_receives=settings.tenant_max_receives,
            max_streams=settings.tenant_max_streams,
            receive_timeout_s=settings.receive_timeout_s,
            clock=self.clock,
        )
        self.inflight_bytes = ByteBudget(settings.max_inflight_bytes)
        self.status = StatusLoop(
            driver=self.driver,
            catalog=self.catalog,
            peers=self.peers,
            watches=(self.membership.watch, *self.peers.watches),
            cache=self.cache,
            live=self.live,
            metrics=self.metrics,
            inflight_bytes=self.inflight_bytes,
            health=self.health,
            autoscale=config.autoscale,
            etcd_connected=self._etcd_connected,
            clock=self.clock,
            pressure=CpuPressure(),
            door=self.door,
        )
        self.dataplane = DataPlane(
            backend,
            self.catalog,
            settings=settings,
            metrics=self.metrics,
            clock=self.clock,
            tenants=self.peers.current_directory,
            cache=self.cache,
            idempotency=self.idempotency,
            audit=self.auditor,
            live=self.live,
            levels=config.admission.priority_levels,
            inflight_bytes=self.inflight_bytes,
            tracer=None if self.tracer_provider is None else tracer(self.tracer_provider, "sluice.router"),
            keys=self.keys,
        )
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._registration: LeasedKey | None = None
        self._stopped = False

    def inference_servicer(self) -> InferenceServicer:
        """The KServe servicer behind this router's front door (the receive gate asks the same door);
        `start` serves it, and bench/router_python.py drives it without a server."""
        door = FrontDoor(
            self.door,
            self.metrics,
            self.queue_probe.token,
            self.queue_probe.arrived,
            self.keys,
            self.config.admission.priority_levels,
        )
        self.receives.door = door
        return InferenceServicer(
            self.dataplane,
            settings=self.config.router,
            malformed=self.malformed,
            inflight_bytes=self.inflight_bytes,
            door=door,
        )

    def _servicers(self, server: grpc.aio.Server) -> None:
        inference = self.inference_servicer()
        door = self.receives.door
        admin = RouterAdminServicer(
            router_id=lambda: self.router_id,
            membership=self.membership,
            driver=self.driver,
            catalog=self.catalog,
            peers=self.peers,
            cache=self.cache,
            live=self.live,
            desired_workers=self.status.desired_workers,
            clock=self.clock,
        )
        gated = GatedServer(server, self.receives)  # the auth gate too: a call it refuses never takes a slot
        add_service(gated, INFERENCE_DESCRIPTOR, inference, self.malformed, door)
        add_service(gated, admin_pb2.DESCRIPTOR.services_by_name["RouterAdmin"], admin, self.malformed)
        generic = cast(grpc.aio.Server, GenericOnly(gated))  # the generated code calls its two add_* only
        health_pb2_grpc.add_HealthServicer_to_server(self.health, generic)
        # Operator tools find routers in etcd: this proves to them who answers before they send an admin key.
        identity = router_identity_servicer(
            self.config.cluster, lambda: self.router_id or "starting", self.clock
        )
        worker_pb2_grpc.add_ClusterIdentityServicer_to_server(identity, generic)
        # The aio servicer through the generic handler, as `enable_server_reflection` would register it:
        # an always-open service, on the server itself, and without a request-call queue of its own.
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(  # type: ignore[no-untyped-call]
            reflection.aio.ReflectionServicer(
                (
                    INFERENCE_SERVICE,
                    admin_pb2.DESCRIPTOR.services_by_name["RouterAdmin"].full_name,
                    worker_pb2.DESCRIPTOR.services_by_name["ClusterIdentity"].full_name,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                )
            ),
            cast(grpc.aio.Server, GenericOnly(server)),
        )

    async def start(self) -> None:
        """Bind, serve, register in etcd and start following workers. A start that fails part way releases
        what it took before raising (`stop`: the ports, the probe socket's folder, the registration), so a
        process or test session that goes on holds none of it."""
        try:
            await self._start()
        except BaseException:
            try:
                await self.stop(grace=0.0)
            except Exception as also:  # each failed step is logged by `stop`; the start's failure is raised
                log.debug("router start: releasing after the failure also failed: %r", also)
            raise

    async def _start(self) -> None:
        settings = self.config.router
        size = settings.max_message_bytes
        server = grpc.aio.server(
            options=[
                *SERVER_KEEPALIVE_OPTIONS,
                *SERVER_QUEUE_OPTIONS,
                ("grpc.max_send_message_length", size),
                ("grpc.max_receive_message_length", size),
                ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
            ],
        )
        self._servicers(server)
        self.queue_probe.listen_on(server)
        self.port = self._bind(server)
        await server.start()
        self._server = server
        self._metrics_endpoint = MetricsEndpoint(
            self.metrics.registry, settings.metrics_port, listen_host(settings.listen)
        )
        host = settings.listen.rsplit(":", 1)[0]
        advertised = f"{socket.gethostname() if host in ('0.0.0.0', '[::]') else host}:{self.port}"
        self.router_id = self.router_id or f"{socket.gethostname()}-{os.getpid()}-{self.port}"
        key = router_key(self.config.etcd.prefix, self.router_id)
        self._registration = LeasedKey(self.config.etcd, key, router_record(advertised, None))
        self.driver.start()
        self.membership.start()
        self.peers.start(self.router_id, self._registration, advertised)
        self.status.start()
        self.queue_probe.start()
        await self._registration.start()
        log.info(
            "router %s serving on %s (metrics :%d, %s event loop, policy core %s)",
            self.router_id, advertised, self.metrics_port, running_loop_name(), compiled_core.status(),
        )  # fmt: skip

    def _etcd_connected(self) -> bool:
        """Whether this router's etcd registration holds its lease now (False before `start` made it)."""
        return self._registration is not None and self._registration.connected

    def _bind(self, server: grpc.aio.Server) -> int:
        """Listen on the client port, with TLS (optionally requiring client certificates) if configured."""
        settings = self.config.router
        tls = settings.tls
        if tls.cert_file is None or tls.key_file is None:
            return listen(server, settings.listen, None, what="router")
        credentials = server_credentials(
            cert_file=tls.cert_file,
            key_file=tls.key_file,
            client_ca_file=tls.client_ca_file,
            require_client_cert=tls.require_client_cert,
            section="router.tls",
            ca_key="client_ca_file",
        )
        return listen(server, settings.listen, credentials, what="router")

    @property
    def metrics_port(self) -> int:
        """The bound /metrics port."""
        return 0 if self._metrics_endpoint is None else self._metrics_endpoint.port

    async def stop(self, grace: float = 2.0) -> None:
        """Deregister, stop accepting, settle every request, close streams (idempotent).

        Every step runs, each within `STOP_STEP_S` (plus `grace` for the server), even when an earlier one
        failed: a step that raised (etcd unreachable at the revoke, say) must not leave the gRPC server,
        its port and the worker streams behind in a process that goes on, as an embedding test session
        does. The first failure is raised once everything has been released."""
        if self._stopped:
            return
        self._stopped = True
        steps: list[tuple[str, Callable[[], Awaitable[object]], float]] = [
            ("health", self.health.enter_graceful_shutdown, STOP_STEP_S),
            ("peers", self.peers.stop, STOP_STEP_S),  # first: it publishes in the registration revoked next
            ("registration", self._revoke, STOP_STEP_S),
            ("status", self.status.stop, STOP_STEP_S),
            ("queue probe", self.queue_probe.stop, STOP_STEP_S),
            ("server", lambda: self._stop_server(grace), grace + STOP_STEP_S),
            ("auditor", self.auditor.stop, STOP_STEP_S),
            ("driver", self.driver.stop, STOP_STEP_S),
            ("membership", self.membership.stop, STOP_STEP_S),
            ("idempotency store", self.idempotency.store.close, STOP_STEP_S),
            ("redis", self._close_redis, STOP_STEP_S),
        ]
        failures: list[BaseException] = []
        for name, step, limit in steps:
            try:
                await self._within(step(), limit)
            except Exception as exc:  # a timeout too: the next steps still release what they own
                log.error("router stop: %s failed: %r", name, exc)
                failures.append(exc)
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush()
        if failures:
            raise failures[0]

    async def _within(self, step: Awaitable[object], limit: float) -> None:
        """Run one stop step for at most `limit` seconds of the router's clock; a step still running then
        is cancelled and left behind (not awaited: a step that ignores its cancel must not hold the stop)."""
        task = asyncio.ensure_future(step)
        if not await wait_until(self.clock, {task}, self.clock.now() + limit):
            task.cancel()
            task.add_done_callback(_retrieve_outcome)
            raise TimeoutError(f"not done within {limit} s")
        await task

    async def _revoke(self) -> None:
        if self._registration is not None:
            await self._registration.revoke()

    async def _stop_server(self, grace: float) -> None:
        if self._server is not None:
            await self._server.stop(grace)

    async def _close_redis(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


async def serve_router(config: SluiceConfig) -> None:
    """Run a router until SIGINT or SIGTERM."""
    router = RouterServer(config)
    await router.start()
    settle_after_startup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):
                loop.remove_signal_handler(sig)
        await router.stop()


def _retrieve_outcome(task: asyncio.Future[object]) -> None:
    """Read a left-behind stop step's outcome so that asyncio does not report it as never retrieved."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.debug("router stop: a step left behind ended with %r", exc)
