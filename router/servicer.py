"""The router's gRPC servicers: KServe v2 inference, and the admin view of workers.

Each method converts protobuf → domain objects, asks the catalog/driver, converts back; errors cross the
boundary once, in `common.grpc_errors.abort`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from opentelemetry.trace import NoOpTracer, SpanKind, Status, StatusCode, Tracer

from common.clock import Clock
from common.config import RouterSettings
from common.errors import Code, DeadlineExceeded, Internal, SluiceError, Unauthenticated
from common.grpc_errors import abort
from common.logs import REQUEST_ID
from common.pb.inference import grpc_service_pb2 as kserve
from common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc, worker_pb2
from common.records import ModelRecord
from common.telemetry import extract
from router.cache_gate import CacheGate
from router.codec import (
    DecodeLimits,
    decode_infer_request,
    encode_infer_response,
    int_parameter,
    model_metadata,
    plain_parameters,
)
from router.driver import Driver
from router.edge import Malformed, MalformedBodies
from router.idempotency_gate import IDEMPOTENCY_HEADER, Claimed, IdempotencyGate
from router.live_stats import LiveStats
from router.membership import Membership
from router.metrics import RouterMetrics
from router.peers import PeerView
from router.policy.budget import ByteBudget
from router.policy.catalog import ModelCatalog
from router.policy.tenants import TenantDirectory

log = logging.getLogger(__name__)

SERVER_NAME = "sluice"
SERVER_VERSION = "0.1.0"
_STATE = {
    "starting": worker_pb2.WORKER_STATE_STARTING,
    "ready": worker_pb2.WORKER_STATE_READY,
    "draining": worker_pb2.WORKER_STATE_DRAINING,
}

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


@dataclass
class _Call:
    """How far one request got, so it is accounted once however it ends."""

    start: float
    model: str = "unknown"
    """The resolved model name once known (a bounded label: registered models only)."""
    tenant: str = ""
    priority: int | None = None
    held: int = 0
    """Bytes held against the in-flight budget."""
    claimed: Claimed | None = None


class InferenceServicer(kserve_grpc.GRPCInferenceServiceServicer):
    """`inference.GRPCInferenceService` over the driver."""

    def __init__(
        self,
        driver: Driver,
        catalog: ModelCatalog,
        *,
        settings: RouterSettings,
        metrics: RouterMetrics,
        clock: Clock,
        tenants: Callable[[], TenantDirectory],
        cache: CacheGate,
        idempotency: IdempotencyGate,
        live: LiveStats,
        levels: int,
        malformed: MalformedBodies,
        inflight_bytes: ByteBudget,
        tracer: Tracer | None = None,
    ) -> None:
        self._driver = driver
        self._live = live
        self._tracer = tracer or NoOpTracer()
        self._cache = cache
        self._idempotency = idempotency
        self._tenants = tenants
        self._catalog = catalog
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._bytes = inflight_bytes
        self._levels = levels
        self._limits = DecodeLimits(settings.max_timeout_s, settings.max_message_bytes)
        self._malformed = malformed

    async def ServerLive(
        self, request: kserve.ServerLiveRequest, context: Context
    ) -> kserve.ServerLiveResponse:
        """Alive whenever it answers."""
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: kserve.ServerReadyRequest, context: Context
    ) -> kserve.ServerReadyResponse:
        """Ready when the decision loop runs and at least one worker accepts batches."""
        healthy = self._driver.healthy(self._clock.now())
        ready = healthy and any(w.accepting for w in self._driver.core.workers)
        return kserve.ServerReadyResponse(ready=ready)

    async def ModelReady(
        self, request: kserve.ModelReadyRequest, context: Context
    ) -> kserve.ModelReadyResponse:
        """Ready when an accepting worker has the (resolved) version loaded; PERMISSION_DENIED for a
        model outside the caller's tenant's globs (checked before the name is resolved, so the answer
        does not tell whether such a model exists)."""
        try:
            tenant = self._tenants().authenticate(api_key(context.invocation_metadata()))
            TenantDirectory.authorize(tenant, request.name)
            record = self._catalog.resolve(request.name, request.version)
        except SluiceError as err:
            await abort(context, err)
        return kserve.ModelReadyResponse(ready=self._driver.core.serves(record.name, record.version))

    async def ServerMetadata(
        self, request: kserve.ServerMetadataRequest, context: Context
    ) -> kserve.ServerMetadataResponse:
        """Name and version; no optional protocol extensions yet."""
        return kserve.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION)

    async def ModelMetadata(
        self, request: kserve.ModelMetadataRequest, context: Context
    ) -> kserve.ModelMetadataResponse:
        """Tensor specs as the workers registered them; PERMISSION_DENIED as in `ModelReady`."""
        try:
            tenant = self._tenants().authenticate(api_key(context.invocation_metadata()))
            TenantDirectory.authorize(tenant, request.name)
            record = self._catalog.resolve(request.name, request.version)
        except SluiceError as err:
            await abort(context, err)
        return model_metadata(record, self._catalog.versions(record.name))

    async def ModelInfer(
        self, request: kserve.ModelInferRequest, context: Context
    ) -> kserve.ModelInferResponse:
        """One request through validation, the queue, a batch and a worker."""
        try:
            return await self._infer(request, context.time_remaining(), context.invocation_metadata())
        except SluiceError as err:
            await abort(context, err)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[kserve.ModelInferRequest | Malformed], context: Context
    ) -> AsyncIterator[kserve.ModelStreamInferResponse]:
        """Requests are served concurrently, at most `stream_max_inflight` at once: the stream is not read
        further until an answer has been written (backpressure). Every request gets exactly one response,
        its result or its error in-band, in completion order."""
        answers: asyncio.Queue[kserve.ModelStreamInferResponse | None] = asyncio.Queue()
        slots = asyncio.Semaphore(self._settings.stream_max_inflight)
        tasks: set[asyncio.Task[None]] = set()

        async def serve_one(request: kserve.ModelInferRequest | Malformed) -> None:
            answer = kserve.ModelStreamInferResponse()
            try:
                if isinstance(request, Malformed):
                    self._malformed.seen("inference.GRPCInferenceService/ModelStreamInfer", request)
                    raise request.error()
                response = await self._infer(request, context.time_remaining(), context.invocation_metadata())
                answer.infer_response.CopyFrom(response)
            except SluiceError as err:
                _error_in_band(answer, request, err)
            except Exception as exc:  # never leave a stream request unanswered, whatever failed
                log.exception("stream request failed on an unexpected error")
                _error_in_band(answer, request, Internal(f"internal error ({type(exc).__name__})"))
            finally:
                answers.put_nowait(answer)

        async def read_all() -> None:
            try:
                async for request in request_iterator:
                    await slots.acquire()
                    task = asyncio.create_task(serve_one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*list(tasks))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read_all())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
                slots.release()
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *list(tasks), return_exceptions=True)

    def _resolve(self, name: str, version: str) -> ModelRecord:
        """The record to serve: the version asked for, or the highest version a worker accepts batches for
        right now (a version registered but not yet connected would only answer UNAVAILABLE)."""
        if not version:
            serving = [v for v in self._catalog.versions(name) if self._driver.core.serves(name, v)]
            if serving:
                return self._catalog.resolve(name, serving[-1])
        return self._catalog.resolve(name, version)

    async def _infer(
        self,
        request: kserve.ModelInferRequest,
        time_remaining: float | None,
        metadata: Iterable[tuple[str, Any]] | None,
    ) -> kserve.ModelInferResponse:
        """One traced request (the span's parent is the caller's `traceparent`, if any)."""
        attributes = {"sluice.model": request.model_name, "sluice.request_id": request.id}
        with self._tracer.start_as_current_span(
            "sluice.infer", context=extract(metadata), kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            request_id = request.id or f"{span.get_span_context().trace_id:032x}"
            token = REQUEST_ID.set(request_id)
            try:
                return await self._serve(request, time_remaining, metadata)
            except SluiceError as err:
                span.set_status(Status(StatusCode.ERROR, f"{err.code.name}: {err.message}"))
                raise
            finally:
                REQUEST_ID.reset(token)

    async def _serve(
        self,
        request: kserve.ModelInferRequest,
        time_remaining: float | None,
        metadata: Iterable[tuple[str, Any]] | None,
    ) -> kserve.ModelInferResponse:
        """One request through the data plane, accounted once however it ends."""
        call = _Call(self._clock.now())
        try:
            response = await self._run(call, request, time_remaining, metadata)
        except SluiceError as err:
            if call.claimed is not None:
                await self._idempotency.failed(call.claimed, err)
            self._count_failure(call, err)
            raise
        except Exception as exc:  # a bug must end this request with a status, and only this request
            log.exception("request failed on an unexpected error")
            if call.claimed is not None:
                await self._idempotency.failed(call.claimed, None)
            bug = Internal(f"internal error ({type(exc).__name__})", reason="internal")
            self._count_failure(call, bug)
            raise bug from exc
        except asyncio.CancelledError:
            if call.claimed is not None:
                await self._idempotency.failed(call.claimed, None)
            self._metrics.requests.labels(call.model, Code.CANCELLED.name).inc()
            raise
        finally:
            self._bytes.release(call.held)
        self._metrics.requests.labels(call.model, Code.OK.name).inc()
        latency = self._clock.now() - call.start
        self._metrics.request_latency.labels(call.model).observe(latency)
        self._live.record(call.model, call.start + latency, latency, good=True)
        return response

    async def _run(
        self,
        call: _Call,
        request: kserve.ModelInferRequest,
        time_remaining: float | None,
        metadata: Iterable[tuple[str, Any]] | None,
    ) -> kserve.ModelInferResponse:
        """authn → in-flight bytes → validation and authz → idempotency → cache → admission and the queue
        (DESIGN.md §1); `call` records how far it got."""
        tenant = self._tenants().authenticate(api_key(metadata))
        call.tenant = tenant.name
        call.held += self._hold(request.ByteSize())
        priority = call.priority = tenant.priority(int_parameter(request, "priority") or 0, self._levels)
        record = self._resolve(request.model_name, request.model_version)
        call.model = record.name
        TenantDirectory.authorize(tenant, record.name)
        decoded = decode_infer_request(request, record, self._limits)
        # What the request holds besides its body: the decoded inputs, the worker's answer and the response.
        call.held += self._hold(decoded.input_bytes + 2 * decoded.response_bytes)
        deadline = call.start + self._time_allowed(time_remaining, decoded.timeout_s)
        parameters = plain_parameters(request)
        begun = await self._idempotency.begin(
            metadata_value(metadata, IDEMPOTENCY_HEADER),
            tenant.name,
            request,
            decoded=decoded,
            parameters=parameters,
            remaining_s=deadline - call.start,
        )
        if isinstance(begun, kserve.ModelInferResponse):
            return begun
        call.claimed = begun

        async def execute() -> kserve.ModelInferResponse:
            reply = await self._driver.infer(decoded, deadline, tenant, priority)
            return encode_infer_response(decoded, reply.outputs, reply.served)

        lookup = self._cache.lookup(tenant.name, record, decoded, parameters)
        response = await self._cache.serve(lookup, record, decoded, execute)
        if call.claimed is not None:
            await self._idempotency.succeeded(call.claimed, response)
            call.claimed = None  # settled: a retry replays it
        if self._clock.now() > deadline:
            # The promise is made here, so it is kept here: never OK after the deadline this router set.
            raise DeadlineExceeded("the answer was ready only after the deadline", reason="finished_late")
        return response

    def _count_failure(self, call: _Call, err: SluiceError) -> None:
        now = self._clock.now()
        self._live.record(call.model, now, now - call.start, good=False)
        self._metrics.requests.labels(call.model, err.code.name).inc()
        self._metrics.rejected(err, call.tenant, call.priority)

    def _hold(self, size: int) -> int:
        """Count `size` bytes against the in-flight budget (RESOURCE_EXHAUSTED beyond it)."""
        self._bytes.acquire(size)
        return size

    def _time_allowed(self, time_remaining: float | None, timeout_s: float | None) -> float:
        """Seconds until the deadline: the earlier of the gRPC deadline and `parameters["timeout"]`, else
        the default; never more than `max_timeout_s` (a request may only shorten the server's limit)."""
        budgets = [t for t in (time_remaining, timeout_s) if t is not None]
        return min(*(budgets or [self._settings.default_timeout_s]), self._settings.max_timeout_s)


def _error_in_band(
    answer: kserve.ModelStreamInferResponse, request: kserve.ModelInferRequest | Malformed, err: SluiceError
) -> None:
    """A stream answer carrying the error, echoing the request's model and id (cut short)."""
    if isinstance(request, kserve.ModelInferRequest):
        answer.infer_response.model_name = request.model_name[:256]
        answer.infer_response.id = request.id[:256]
    answer.error_message = f"{err.code.name}: {err.message}"


def metadata_value(metadata: Iterable[tuple[str, Any]] | None, name: str) -> str | None:
    """The first value of a metadata key, as text; None when absent."""
    for key, value in metadata or ():
        if key == name:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def api_key(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The key in `authorization: Bearer <key>`, or None when absent."""
    text = metadata_value(metadata, "authorization")
    if text is None:
        return None
    scheme, _, token = text.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata must be 'Bearer <api key>'", reason="bad_auth_header")
    return token.strip()


class RouterAdminServicer(admin_pb2_grpc.RouterAdminServicer):
    """`sluice.v1.RouterAdmin`: the router's live view for operators and the CLI."""

    def __init__(
        self,
        *,
        router_id: Callable[[], str],
        membership: Membership,
        driver: Driver,
        catalog: ModelCatalog,
        peers: PeerView,
        cache: CacheGate,
        live: LiveStats,
        desired_workers: Callable[[str], int],
        clock: Clock,
    ) -> None:
        self._router_id = router_id
        self._membership = membership
        self._driver = driver
        self._catalog = catalog
        self._peers = peers
        self._cache = cache
        self._live = live
        self._desired = desired_workers
        self._clock = clock

    async def ListWorkers(
        self, request: admin_pb2.ListWorkersRequest, context: Context
    ) -> admin_pb2.ListWorkersResponse:
        """Every worker in etcd with its stream state and load."""
        response = admin_pb2.ListWorkersResponse()
        for worker_id, record in sorted(self._membership.records.items()):
            view = response.workers.add(
                worker_id=worker_id,
                addr=record.addr,
                device=record.device,
                state=_STATE[record.state],
                in_flight_batches=self._driver.core.in_flight_on(worker_id),
                connected=self._membership.load_of(worker_id) is not None,
            )
            estimates = self._driver.core.estimates
            for model in record.models:
                view.models.add(
                    name=model.name,
                    version=model.version,
                    digest=model.digest,
                    max_batch_size=model.max_batch_size,
                )
                view.estimates.add(
                    model=model.name,
                    version=model.version,
                    seconds_one=estimates.batch_seconds(model.name, model.version, 1, worker_id),
                    seconds_full=estimates.batch_seconds(
                        model.name, model.version, model.max_batch_size, worker_id
                    ),
                    max_batch_size=model.max_batch_size,
                )
            view.breaker_open = not self._driver.core.breaker.allows(worker_id, self._clock.now())
            load = self._membership.load_of(worker_id)
            if load is not None:
                view.load.CopyFrom(load)
        return response

    async def GetStats(self, request: admin_pb2.GetStatsRequest, context: Context) -> admin_pb2.RouterStats:
        """Lanes, per-model rates and latencies, the autoscaling signal and cache counters."""
        now = self._clock.now()
        core = self._driver.core
        stats = admin_pb2.RouterStats(router_id=self._router_id(), routers=self._peers.routers)
        for lane in sorted(core.queues.lanes.values(), key=lambda ln: ln.key):
            oldest = lane.oldest_arrival()
            lane_stats = core.queues.stats.get(lane.key)
            stats.lanes.add(
                model=lane.key.model,
                version=lane.key.version,
                shape=",".join(f"{name}{list(dims)}" for name, dims in lane.key.shape),
                depth=len(lane),
                oldest_age_s=0.0 if oldest is None else now - oldest,
                arrival_rate=0.0 if lane_stats is None else lane_stats.rate(now),
            )
        for model in sorted(set(self._catalog.names()) | set(self._live.models())):
            window = self._live.window(model, now)
            ready = sum(1 for w in core.workers if w.accepting and any(name == model for name, _ in w.models))
            stats.models.add(
                model=model,
                request_rate=window.request_rate,
                error_ratio=window.error_ratio,
                p50_ms=window.p50_s * 1000,
                p99_ms=window.p99_s * 1000,
                desired_workers=self._desired(model),
                ready_workers=ready,
            )
        cache = self._cache.store.stats
        stats.cache.CopyFrom(
            admin_pb2.CacheStats(
                hits=cache.hits,
                misses=cache.misses,
                bypasses=cache.bypasses,
                evictions=cache.evictions,
                memory_bytes=cache.bytes_used,
                entries=cache.entries,
                redis_down=cache.redis_down,
                disabled_digests=sorted(self._cache.disabled_digests),
            )
        )
        return stats

    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: Context
    ) -> admin_pb2.ListTenantsResponse:
        """Quotas and this router's usage."""
        limiter = self._driver.core.admission.limiter
        levels = limiter.levels(self._clock.now())
        response = admin_pb2.ListTenantsResponse(routers=limiter.routers)
        directory = self._peers.current_directory()
        for name in directory.names():
            tenant = directory.get(name)
            assert tenant is not None
            s = tenant.settings
            response.tenants.add(
                name=name,
                rate=s.rate,
                burst=s.burst,
                max_inflight=s.max_inflight,
                weight=s.weight,
                default_priority=s.default_priority,
                max_priority=s.max_priority,
                inflight_share=limiter.inflight_cap(name) or 0,
                inflight=limiter.inflight.get(name, 0),
                tokens=levels.get(name, 0.0),
                models=s.models,
            )
        return response

    async def PurgeCache(
        self, request: admin_pb2.PurgeCacheRequest, context: Context
    ) -> admin_pb2.PurgeCacheResponse:
        """Drop a model's cached results here and in the shared Redis."""
        try:
            result = await self._cache.store.purge_model(request.model, request.version or None)
        except SluiceError as err:
            await abort(context, err)
        return admin_pb2.PurgeCacheResponse(memory_entries=result.memory, redis_entries=result.redis)
