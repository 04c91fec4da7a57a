"""Worker process lifecycle: load → warm up → serve → register → (SIGTERM) drain → deregister → exit 0.

Readiness is earned in that order: a worker registers in etcd (and reports SERVING on grpc.health.v1)
only after every model version has loaded and run its warm-up batches, so no request ever pays for a cold
model. Draining marks the worker `draining` in etcd and on every router stream, finishes every batch it
accepted, then revokes its lease so the registration disappears at once.

A device fault (worker/faults.py) cuts this short: the worker cannot finish anything, so it leaves at once
(DRAINING on every stream, NOT_SERVING on every health service, lease revoked, streams closed so routers
re-dispatch what it had not answered) and exits with `EXIT_DEVICE_FAULT` for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from sluice_inference.common.clock import MonotonicClock
from sluice_inference.common.cluster_auth import (
    IdentityServicer,
    require_worker_credentials,
    worker_identity,
    worker_server_credentials,
)
from sluice_inference.common.cluster_proof import ProofIssuer
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.dev_token import refuse_dev_token
from sluice_inference.common.errors import Internal
from sluice_inference.common.etcd import LeasedKey, worker_key
from sluice_inference.common.event_loop import running_loop_name
from sluice_inference.common.exit_codes import EXIT_DEVICE_FAULT
from sluice_inference.common.grpc_gate import GateInterceptor
from sluice_inference.common.grpc_server import keepalive_options, listen
from sluice_inference.common.heap import settle_after_startup
from sluice_inference.common.metrics import MetricsEndpoint, listen_host
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluice_inference.common.records import WorkerRecord, WorkerStateName
from sluice_inference.common.telemetry import provider_from_environment, tracer
from sluice_inference.worker.auth import ClusterProofGate, check_peer_role
from sluice_inference.worker.backends import load_backend
from sluice_inference.worker.executor import Executor, LoadedModel, warmup_items
from sluice_inference.worker.gpu_metrics import GpuSampler
from sluice_inference.worker.metrics import WorkerMetrics
from sluice_inference.worker.report_cadence import ReportCadence
from sluice_inference.worker.repository import scan_repository
from sluice_inference.worker.runner import BatchRunner
from sluice_inference.worker.servicer import WorkerAdminServicer, WorkerState, WorkerStreamServicer

log = logging.getLogger(__name__)

GPU_SAMPLE_INTERVAL_S = 1.0
"""NVML's utilisation and memory, sampled with the load report at most this often."""
# Time for routers to see DRAINING on their stream before we trust the runner's idleness.
DRAIN_SETTLE_S = 0.2
MIN_PING_INTERVAL_MS = 400
"""Below the routers' 500 ms stream pings (router/worker_link.py), so theirs never strike."""
SERVER_OPTIONS = keepalive_options(MIN_PING_INTERVAL_MS)
_STATE_NAMES: dict[int, WorkerStateName] = {
    worker_pb2.WORKER_STATE_STARTING: "starting",
    worker_pb2.WORKER_STATE_READY: "ready",
    worker_pb2.WORKER_STATE_DRAINING: "draining",
}


class WorkerProcess:
    """One worker: owns a device, its models, its gRPC server and its etcd registration."""

    def __init__(self, config: SluiceConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.config = config
        self.tracer_provider = tracer_provider or provider_from_environment("sluice-worker")
        settings = config.worker
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = WorkerMetrics()
        self.clock = MonotonicClock()
        self.executor = Executor(settings.device, settings.torch_threads)
        self.models: dict[tuple[str, str], LoadedModel] = {}
        self.warmup_s: dict[tuple[str, str], dict[int, float]] = {}
        self.runner = BatchRunner(
            self.executor,
            self.models,
            self.metrics,
            capacity=settings.capacity,
            clock=self.clock,
            tracer=tracer(self.tracer_provider, "sluice.worker"),
            on_device_fault=self._on_device_fault,
            forward_on_loop=settings.forward_on_loop,
        )
        self.state = WorkerState(
            self.worker_id, self.runner, ReportCadence(self.clock, settings.idle_report_interval_s)
        )
        self.health = HealthServicer()
        self.port = 0
        self.started_at = time.time()
        self.drained = asyncio.Event()
        self.faulted = asyncio.Event()
        """Set once the worker has left after a device fault; the process must then exit and be replaced."""
        self._server: grpc.aio.Server | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._registration: LeasedKey | None = None
        self._reporter: asyncio.Task[None] | None = None
        self._drain_lock = asyncio.Lock()
        self._leaving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load and warm every model, serve, then register as ready. ConfigError (before any model is
        loaded) when the worker has no way to tell a router's batch from anyone else's. A start that
        fails part way releases what it took before raising (`stop`: the device thread, the port, the
        metrics endpoint), so a process or test session that goes on holds none of it."""
        try:
            await self._start()
        except BaseException:
            try:
                await self.stop(grace=0.0)
            except Exception as also:
                log.debug("worker start: releasing after the failure also failed: %r", also)
            raise

    async def _start(self) -> None:
        settings = self.config.worker
        require_worker_credentials(self.config.cluster, self.worker_id)
        refuse_dev_token(self.config.cluster, dev=settings.dev)
        credentials = worker_server_credentials(self.config.cluster)
        await asyncio.to_thread(self._load_models)
        self.runner.start()
        issuer = ProofIssuer(self.config.cluster.accepted())
        server = self._server_for(self.config.cluster.max_message_bytes, issuer)
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerStreamServicer(self.state), server)
        identity = IdentityServicer(lambda: worker_identity(self.worker_id), issuer, self.clock)
        worker_pb2_grpc.add_ClusterIdentityServicer_to_server(identity, server)
        admin = WorkerAdminServicer(self.state, self.drain, self.status, self.clock)
        admin_pb2_grpc.add_WorkerAdminServicer_to_server(admin, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
                worker_pb2.DESCRIPTOR.services_by_name["ClusterIdentity"].full_name,
                admin_pb2.DESCRIPTOR.services_by_name["WorkerAdmin"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.port = listen(server, settings.listen, credentials, what="worker")
        await server.start()
        self._server = server
        self._metrics_endpoint = MetricsEndpoint(
            self.metrics.registry, settings.metrics_port, listen_host(settings.listen)
        )
        self.state.set(worker_pb2.WORKER_STATE_READY)
        key = worker_key(self.config.etcd.prefix, self.worker_id)
        self._registration = LeasedKey(self.config.etcd, key, self.record().to_json())
        await self._registration.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._reporter = asyncio.create_task(self._report_load(), name="load-reporter")
        log.info(
            "worker %s ready on %s with %d model versions (%s event loop)",
            self.worker_id, self.addr, len(self.models), running_loop_name(),
        )  # fmt: skip

    def _server_for(self, max_message_bytes: int, issuer: ProofIssuer) -> grpc.aio.Server:
        """The gRPC server: message limits the routers' agree with, and the cluster gate: the caller's
        token proof (before the request is read) and, under mTLS, the role its certificate names."""
        proofs = ClusterProofGate(self.worker_id, issuer, self.clock) if issuer.enabled else None
        roles = check_peer_role if self.config.cluster.tls else None
        gate = GateInterceptor(proofs or _no_metadata_check, roles)
        return grpc.aio.server(
            interceptors=[gate],
            options=[
                *SERVER_OPTIONS,
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )

    def _load_models(self) -> None:
        settings = self.config.worker
        warned: set[str] = set()
        for spec in scan_repository(settings.repository, settings.models):
            if spec.warnings and spec.name not in warned:
                warned.add(spec.name)
                log.warning(
                    "model %s (%s): not applied: %s", spec.name, spec.config_path, "; ".join(spec.warnings)
                )
            model = LoadedModel(spec, load_backend(spec, settings.device, settings.synthetic_slowdown))
            self.executor.warm_up(model)
            self.warmup_s[(spec.name, spec.version)] = self._time_warm_batches(model)
            self.models[(spec.name, spec.version)] = model
        if not self.models:
            raise RuntimeError(f"no models to serve in {settings.repository}")

    def _time_warm_batches(self, model: LoadedModel) -> dict[int, float]:
        """Forward time per warm-up batch size on the now-warm model: routers seed their estimates with it."""
        timings = {}
        for size in model.spec.config.warmup_sizes:
            items = warmup_items(model.spec.config, size)
            start = time.perf_counter()
            self.executor.run(model, items)
            timings[size] = time.perf_counter() - start
        return timings

    @property
    def addr(self) -> str:
        """host:port routers dial."""
        return f"{self.config.worker.advertise_host}:{self.port}"

    @property
    def metrics_port(self) -> int:
        """The bound /metrics port."""
        return 0 if self._metrics_endpoint is None else self._metrics_endpoint.port

    def record(self) -> WorkerRecord:
        """What this worker publishes in etcd."""
        return WorkerRecord(
            worker_id=self.worker_id,
            addr=self.addr,
            device=self.config.worker.device,
            models=tuple(
                m.spec.record().model_copy(update={"warmup_s": self.warmup_s.get(key, {})})
                for key, m in self.models.items()
            ),
            capacity=self.config.worker.capacity,
            state=_STATE_NAMES[self.state.state],
            started_at=self.started_at,
        )

    def status(self) -> admin_pb2.WorkerStatusResponse:
        """The admin Status answer."""
        response = admin_pb2.WorkerStatusResponse(
            worker_id=self.worker_id,
            device=self.config.worker.device,
            state=self.state.state,
            load=self.state.load_report(),
            batches_executed=self.runner.batches_executed,
            items_executed=self.runner.items_executed,
        )
        for model in self.models.values():
            r = model.spec.record()
            response.models.add(
                name=r.name, version=r.version, digest=r.digest, max_batch_size=r.max_batch_size
            )
        return response

    async def _report_load(self) -> None:
        """The heartbeat: a load report on every stream when the cadence says (worker/heartbeat.py)."""
        gpu = GpuSampler.create(self.config.worker.device, self.metrics)
        cadence = self.state.cadence
        sampled_gpu = self.clock.now()
        while True:
            await cadence.wait()
            cadence.plan_next(
                holding_work=self.runner.pending_batches > 0,
                every_stream_reads=self.state.every_stream_reads_interval(),
            )
            self.state.broadcast()
            self.metrics.busy_ratio.set(self.runner.busy_fraction())
            connected = self._registration is not None and self._registration.connected
            self.metrics.etcd_up.set(1 if connected else 0)
            if gpu is not None and (now := self.clock.now()) - sampled_gpu >= GPU_SAMPLE_INTERVAL_S:
                sampled_gpu = now
                gpu.sample()

    async def drain(self) -> None:
        """Mark draining everywhere, finish accepted batches, revoke the lease (once)."""
        async with self._drain_lock:
            if self.drained.is_set() or self._leaving is not None:
                return  # drained already, or leaving after a device fault (nothing left to finish)
            log.info("worker %s draining", self.worker_id)
            self.state.set(worker_pb2.WORKER_STATE_DRAINING)
            await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            if self._registration is not None:
                await self._registration.update(self.record().to_json())
            await self.clock.sleep(DRAIN_SETTLE_S)
            finished = await self.runner.wait_idle(self.config.worker.drain_timeout_s)
            if not finished:
                log.error("drain timed out with %d batches in flight", self.runner.pending_batches)
            if self._registration is not None:
                await self._registration.revoke()
            self.drained.set()
            log.info("worker %s drained", self.worker_id)

    def _on_device_fault(self, fault: Internal) -> None:
        """The runner met a device fault (on the event loop, after answering that batch): leave, once."""
        if self._leaving is None:
            self._leaving = asyncio.create_task(self._leave_after_fault(fault), name="device-fault")

    async def _leave_after_fault(self, fault: Internal) -> None:
        """Take this worker out everywhere at once; unlike a drain there is nothing left to finish."""
        message = "worker %s: device fault, leaving to be restarted: %s"
        log.error(message, self.worker_id, fault.message, exc_info=fault)
        self.state.set(worker_pb2.WORKER_STATE_DRAINING)  # routers stop sending on every stream now
        await self.health.enter_graceful_shutdown()  # NOT_SERVING on every service, never SERVING again
        if self._registration is not None:
            await self._registration.revoke()  # the etcd key disappears at once, not after the TTL
        for stream in list(self.state.streams):
            stream.outbox.put_nowait(None)  # after the answered batch's result: then the stream ends
        self.faulted.set()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (after `drain`, or abruptly without it)."""
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)
        for stream in list(self.state.streams):
            stream.outbox.put_nowait(None)
        if self._server is not None:
            await self._server.stop(grace)
        if self._registration is not None:
            await self._registration.revoke()
        await self.runner.stop()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush()


def _no_metadata_check(method: str, metadata: object) -> None:
    """The metadata gate of a cluster without a token: mTLS already admitted the caller (roles follow)."""


async def serve_worker(config: SluiceConfig) -> None:
    """Run a worker until SIGTERM/SIGINT (then drain) or an admin Drain; returns when drained.

    After a device fault it stops everything and raises SystemExit(EXIT_DEVICE_FAULT), so the process
    exits with that status whoever runs this coroutine (asyncio.run lets SystemExit through).
    """
    worker = WorkerProcess(config)
    await worker.start()
    settle_after_startup()
    loop = asyncio.get_running_loop()
    drain_task: set[asyncio.Task[None]] = set()

    def on_signal() -> None:
        if not drain_task:
            drain_task.add(asyncio.create_task(worker.drain()))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await _first_of(worker.drained, worker.faulted)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):
                loop.remove_signal_handler(sig)
        await worker.stop()
    if worker.faulted.is_set():
        log.error("worker %s exits with %d to be restarted", worker.worker_id, EXIT_DEVICE_FAULT)
        raise SystemExit(EXIT_DEVICE_FAULT)


async def _first_of(*events: asyncio.Event) -> None:
    """Wait until any of `events` is set."""
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
