"""The router's gRPC servicers: KServe v2 inference over the data plane, and the admin view of workers.

`InferenceServicer` only translates: each method converts protobuf → domain objects
(`router/kserve_codec.py`), asks the data plane (`router/dataplane.py`), and converts back; errors cross
the boundary once, in `sluice_inference.common.grpc_errors.abort` (in-band for `ModelStreamInfer`).

An answer is held against the in-flight byte budget until gRPC has written it: the data plane gives its
bytes back when the call's result is ready, and a client that does not read can keep the answer in the
router long after that. So each answer is charged again here (`ANSWER_COPIES` times its size), in the same
step of the event loop in which the data plane let go of the call's bytes, and given back once written:
for `ModelInfer` when the call's task has ended (grpc.aio runs a call in a task of its own, which ends after
the batch that sends the message and the status completes, or when the call is cancelled), for a stream
once its `yield` has returned (grpc.aio resumes the handler only after the write completed). The task's
done-callback, not the context's: grpc.aio binds the context into a callback it keeps in the call's state,
which makes every such call a reference cycle that only the collector frees (~8 objects a call).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, TypeAlias

import grpc

from sluice_inference.common.clock import Clock
from sluice_inference.common.errors import Internal, SluiceError
from sluice_inference.common.grpc_errors import abort
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.pb.sluice.v1 import admin_pb2, admin_pb2_grpc, worker_pb2
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.common.telemetry import extract_mapping
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.dataplane import DataPlane
from sluice_inference.router.driver import Driver
from sluice_inference.router.edge import OVERLOADED, FrontDoor, Malformed, MalformedBodies
from sluice_inference.router.kserve_codec import (
    CallHead,
    api_key,
    call_from_request,
    model_metadata,
    read_head,
    response_from_result,
)
from sluice_inference.router.live_stats import LiveStats
from sluice_inference.router.membership import Membership
from sluice_inference.router.peers import PeerView
from sluice_inference.router.policy.budget import ByteBudget
from sluice_inference.router.policy.catalog import ModelCatalog

log = logging.getLogger(__name__)

SERVER_NAME = "sluice"
SERVER_VERSION = "0.1.0"
_STATE = {
    "starting": worker_pb2.WORKER_STATE_STARTING,
    "ready": worker_pb2.WORKER_STATE_READY,
    "draining": worker_pb2.WORKER_STATE_DRAINING,
}

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
ANSWER_COPIES = 3
"""Copies of an answer alive while gRPC writes it: the message, its encoding (grpc.aio serializes it into
`bytes`) and the transport's own copy (`SendMessageOperation` copies the bytes into a core slice)."""


class InferenceServicer(kserve_grpc.GRPCInferenceServiceServicer):
    """`inference.GRPCInferenceService` over the data plane."""

    def __init__(
        self,
        plane: DataPlane,
        *,
        settings: RouterSettings,
        malformed: MalformedBodies,
        inflight_bytes: ByteBudget,
        door: FrontDoor | None = None,
    ) -> None:
        self._plane = plane
        self._bytes = inflight_bytes
        self._door = door
        self._stream_max_inflight = settings.stream_max_inflight
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
        return kserve.ServerReadyResponse(ready=self._plane.ready())

    async def ModelReady(
        self, request: kserve.ModelReadyRequest, context: Context
    ) -> kserve.ModelReadyResponse:
        """Ready when an accepting worker has the (resolved) version loaded; PERMISSION_DENIED for a
        model outside the caller's tenant's globs (`DataPlane.model`)."""
        try:
            record = self._plane.model(api_key(context.invocation_metadata()), request.name, request.version)
        except SluiceError as err:
            await abort(context, err)
        return kserve.ModelReadyResponse(ready=self._plane.model_ready(record))

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
            record = self._plane.model(api_key(context.invocation_metadata()), request.name, request.version)
        except SluiceError as err:
            await abort(context, err)
        return model_metadata(record, self._plane.versions(record.name))

    async def ModelInfer(
        self, request: kserve.ModelInferRequest, context: Context
    ) -> kserve.ModelInferResponse:
        """One request through the data plane; its answer held against the budget until written."""
        return await self.infer_from_head(request, context, read_head(context.invocation_metadata()), None)

    async def infer_from_head(
        self, request: kserve.ModelInferRequest, context: Context, head: CallHead, body_bytes: int | None
    ) -> kserve.ModelInferResponse:
        """`ModelInfer` for a caller that has read the call's metadata already (the front door,
        router/edge.py), with the body's size as received when it knows it."""
        try:
            response = await self._infer(request, context, head, body_bytes)
            held = self._hold(response)
        except SluiceError as err:
            await abort(context, err)
        call = asyncio.current_task()
        assert call is not None  # grpc.aio serves every call in a task
        call.add_done_callback(partial(self._written, held))
        return response

    def _written(self, held: int, _call: asyncio.Task[Any]) -> None:
        """A `ModelInfer` call's task has ended: its answer's bytes are written (or never will be)."""
        self._bytes.release(held)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[kserve.ModelInferRequest | Malformed], context: Context
    ) -> AsyncIterator[kserve.ModelStreamInferResponse]:
        """Requests are served concurrently, at most `stream_max_inflight` at once: the stream is not read
        further until an answer has been written (backpressure). Every request gets exactly one response,
        its result or its error in-band, in completion order. An answer waiting to be written holds its
        bytes against the budget (up to `stream_max_inflight` of them while the client does not read)."""
        answers: asyncio.Queue[tuple[kserve.ModelStreamInferResponse, int] | None] = asyncio.Queue()
        slots = asyncio.Semaphore(self._stream_max_inflight)
        tasks: set[asyncio.Task[None]] = set()
        head = read_head(context.invocation_metadata())
        level = 0 if self._door is None else self._door.level(head)

        async def serve_one(request: kserve.ModelInferRequest | Malformed) -> None:
            answers.put_nowait(await self._stream_answer(request, context, head, level))

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
            while (written := await answers.get()) is not None:
                answer, held = written
                try:
                    yield answer
                finally:
                    self._bytes.release(held)
                slots.release()
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *list(tasks), return_exceptions=True)
            while not answers.empty():
                if (unsent := answers.get_nowait()) is not None:
                    self._bytes.release(unsent[1])

    async def _stream_answer(
        self, request: kserve.ModelInferRequest | Malformed, context: Context, head: CallHead, level: int
    ) -> tuple[kserve.ModelStreamInferResponse, int]:
        """One stream request's answer, its result or its error in-band, and the bytes it holds."""
        answer = kserve.ModelStreamInferResponse()
        try:
            if self._door is not None and not self._door.door.admit(level):
                self._door.refused(level)
                raise OVERLOADED
            if isinstance(request, Malformed):
                self._malformed.seen("inference.GRPCInferenceService/ModelStreamInfer", request)
                raise request.error()
            answer.infer_response.CopyFrom(await self._infer(request, context, head, None))
            return answer, self._hold(answer)
        except SluiceError as err:
            answer.ClearField("infer_response")
            _error_in_band(answer, request, err)
        except Exception as exc:  # never leave a stream request unanswered, whatever failed
            log.exception("stream request failed on an unexpected error")
            _error_in_band(answer, request, Internal(f"internal error ({type(exc).__name__})"))
        return answer, 0

    async def _infer(
        self, request: kserve.ModelInferRequest, context: Context, head: CallHead, body_bytes: int | None
    ) -> kserve.ModelInferResponse:
        # The caller's trace context is read only when spans are made: OpenTelemetry's no-op paths still
        # cost microseconds per call.
        trace = head.trace if self._plane.tracing else None
        call = call_from_request(
            request,
            metadata=head,
            time_remaining_s=context.time_remaining(),
            trace_parent=None if trace is None else extract_mapping(trace),
            body_bytes=body_bytes,
        )
        return response_from_result(await self._plane.infer(call))

    def _hold(self, answer: kserve.ModelInferResponse | kserve.ModelStreamInferResponse) -> int:
        """Charge an answer to the budget until it is written (RESOURCE_EXHAUSTED beyond it). Called with
        no await since the data plane released what the call held (its body, inputs and twice the expected
        answer), so this is refused only when the budget is nearly full or the answer's copies exceed what
        the call held: the answer is dropped and the client told to retry, rather than held past the
        budget."""
        size = ANSWER_COPIES * answer.ByteSize()
        self._bytes.acquire(size)
        return size


def _error_in_band(
    answer: kserve.ModelStreamInferResponse, request: kserve.ModelInferRequest | Malformed, err: SluiceError
) -> None:
    """A stream answer carrying the error, echoing the request's model and id (cut short)."""
    if isinstance(request, kserve.ModelInferRequest):
        answer.infer_response.model_name = request.model_name[:256]
        answer.infer_response.id = request.id[:256]
    answer.error_message = f"{err.code.name}: {err.message}"


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
        core = self._driver.core.view
        for worker_id, record in sorted(self._membership.records.items()):
            view = response.workers.add(
                worker_id=worker_id,
                addr=record.addr,
                device=record.device,
                state=_STATE[record.state],
                in_flight_batches=core.in_flight_on(worker_id),
                connected=self._membership.load_of(worker_id) is not None,
            )
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
                    seconds_one=core.batch_seconds(model.name, model.version, 1, worker_id),
                    seconds_full=core.batch_seconds(
                        model.name, model.version, model.max_batch_size, worker_id
                    ),
                    max_batch_size=model.max_batch_size,
                )
            view.breaker_open = core.breaker_open(worker_id, self._clock.now())
            load = self._membership.load_of(worker_id)
            if load is not None:
                view.load.CopyFrom(load)
        return response

    async def GetStats(self, request: admin_pb2.GetStatsRequest, context: Context) -> admin_pb2.RouterStats:
        """Lanes, per-model rates and latencies, the autoscaling signal and cache counters."""
        now = self._clock.now()
        core = self._driver.core.view
        stats = admin_pb2.RouterStats(router_id=self._router_id(), routers=self._peers.routers)
        for lane in core.lanes(now):
            stats.lanes.add(
                model=lane.key.model,
                version=lane.key.version,
                shape=",".join(f"{name}{list(dims)}" for name, dims in lane.key.shape),
                depth=lane.depth,
                oldest_age_s=lane.oldest_age_s,
                arrival_rate=lane.arrival_rate,
            )
        for model in sorted(set(self._catalog.names()) | set(self._live.models())):
            window = self._live.window(model, now)
            ready = core.ready_workers(model)
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
            )
        )
        return stats

    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: Context
    ) -> admin_pb2.ListTenantsResponse:
        """Quotas and this router's usage."""
        core = self._driver.core.view
        usage = core.tenants(self._clock.now())
        response = admin_pb2.ListTenantsResponse(routers=core.routers())
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
                inflight_share=core.inflight_cap(name) or 0,
                inflight=core.inflight(name),
                tokens=usage[name].tokens if name in usage else 0.0,
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
