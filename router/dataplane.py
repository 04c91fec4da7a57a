"""The transport-agnostic data plane: one inference call from its API key to its result.

`DataPlane.infer(InferCall) -> InferResult` runs every step in this order (docs/architecture.md):
authenticate the key → hold the body's bytes → priority → authorize the model name → resolve the
version → validate and make inputs canonical (`router/codec.py`) → hold the decoded inputs and twice the
expected response → set the deadline → idempotency (claim, wait or replay) → the result cache (hit, or one
execution per set of identical misses; a request it answers without executing pays the tenant's rate
through `Backend.charge`) → the driver → store the outcome → never OK after the deadline set here. The
deadline and what counts as late are the deadline budget's (router/policy/deadline_budget.py).

A transport only converts its messages to and from `router/calls.py` objects and maps a `SluiceError` to
its status (`router/servicer.py` for KServe v2 gRPC); an HTTP/REST transport of the same protocol would
reuse this class unchanged. Hits are handed to the auditor here, which keeps the cache gate and the
auditor unaware of each other's insides.

Invariants:
- every call is accounted once however it ends — a result, a typed error, a bug (INTERNAL) or a
  cancellation: one request count under its model (the label is "unknown" until the model resolves, so
  the label set stays bounded), one latency or failure sample;
- every byte a call holds against the in-flight budget is given back when it ends;
- a claimed idempotency key is settled exactly once: its outcome stored, or the key released;
- a call is never answered OK after the deadline this router set for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from sluice_inference.common.clock import Clock
from sluice_inference.common.errors import Code, Internal, SluiceError
from sluice_inference.common.logs import MAX_LOGGED_ID, REQUEST_ID, LogThrottle, loggable_id
from sluice_inference.common.records import ModelRecord
from sluice_inference.common.serving_settings import RouterSettings
from sluice_inference.router.auth import TenantKeys
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.calls import CacheOutcome, InferCall, InferResult
from sluice_inference.router.codec import (
    DecodedRequest,
    DecodeLimits,
    Executor,
    ExecutorReply,
    decode_call,
    int_parameter,
    plain_parameters,
    requested_outputs,
)
from sluice_inference.router.driver import Driver
from sluice_inference.router.idempotency_gate import Claimed, IdempotencyGate
from sluice_inference.router.live_stats import LiveStats
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.budget import ByteBudget
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.policy.core import version_to_serve
from sluice_inference.router.policy.deadline_budget import DeadlineBudget
from sluice_inference.router.policy.result_cache import CacheUse
from sluice_inference.router.policy.tenants import Tenant, TenantDirectory

log = logging.getLogger(__name__)

BUG_LOG_INTERVAL_S = 5.0
_OK = Code.OK.name
_CANCELLED = Code.CANCELLED.name
"""Outcome labels read once: an enum member's `.name` is a descriptor call per request."""


class Backend(Executor, Protocol):
    """What the data plane needs from the queue and the workers: run a request, and say what can run."""

    def serves(self, model: str, version: str) -> bool:
        """Whether a worker accepts batches for this model version now."""
        ...

    def ready(self, now: float) -> bool:
        """Whether the router can serve at all: its decision loop runs and a worker accepts batches."""
        ...

    def charge(self, tenant: Tenant) -> None:
        """A request answered from the cache pays the tenant's rate; RESOURCE_EXHAUSTED when it cannot."""
        ...


class DriverBackend:
    """The asyncio driver as the data plane's `Backend`: the one place the data plane reads the driver."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    async def infer(
        self, decoded: DecodedRequest, deadline: float, tenant: Tenant, priority: int, *, arrival: float
    ) -> ExecutorReply:
        """Queue, batch and run one request (`Driver.infer`)."""
        return await self._driver.infer(decoded, deadline, tenant, priority, arrival=arrival)

    def serves(self, model: str, version: str) -> bool:
        """Whether some accepting worker has this model version."""
        return self._driver.core.view.serves(model, version)

    def ready(self, now: float) -> bool:
        """The decision loop is healthy and some worker accepts batches."""
        return self._driver.healthy(now) and self._driver.core.view.any_accepting()

    def charge(self, tenant: Tenant) -> None:
        """One of the tenant's rate tokens (`Driver.charge`)."""
        self._driver.charge(tenant)


class HitAudit(Protocol):
    """Receives cache hits, to re-run a sample of them (`router/auditor.py`)."""

    def on_hit(
        self, tenant: str, key: str, record: ModelRecord, decoded: DecodedRequest, cached: InferResult
    ) -> None:
        """One hit of `tenant`, as served from the entry under cache key `key`."""
        ...


@dataclass(slots=True)
class _Progress:
    """How far one call got, so it is accounted once however it ends."""

    start: float
    model: str = "unknown"
    """The resolved model name once known (a bounded label: registered models only)."""
    tenant: str = ""
    priority: int | None = None
    held: int = 0
    """Bytes held against the in-flight budget."""
    claimed: Claimed | None = None


class DataPlane:
    """Inference calls through authentication, budgets, validation, idempotency, the cache and the queue."""

    def __init__(
        self,
        backend: Backend,
        catalog: ModelCatalog,
        *,
        settings: RouterSettings,
        metrics: RouterMetrics,
        clock: Clock,
        tenants: Callable[[], TenantDirectory],
        cache: CacheGate,
        idempotency: IdempotencyGate,
        audit: HitAudit,
        live: LiveStats,
        levels: int,
        inflight_bytes: ByteBudget,
        tracer: Tracer | None = None,
        keys: TenantKeys | None = None,
    ) -> None:
        """`tracer` None: no tracing calls at all (no exporter configured). `keys`: the key → tenant
        memory shared with the client port's gate and the front door (router/auth.py); None makes one
        over `tenants`."""
        self._backend = backend
        self._catalog = catalog
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._cache = cache
        self._idempotency = idempotency
        self._audit = audit
        self._live = live
        self._levels = levels
        self._bytes = inflight_bytes
        self._tracer = tracer
        self._keys = keys or TenantKeys(tenants)
        self._limits = DecodeLimits(settings.max_message_bytes)
        self._budget = DeadlineBudget.of(settings)
        """The deadline rules (deadline_budget.py): this plane sets the deadline and keeps its promise."""
        self._bugs = LogThrottle(log, BUG_LOG_INTERVAL_S, clock)
        """Unexpected failures a client may be able to trigger at will: one traceback per interval."""

    # -- model and server queries --------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether this router can serve inference now."""
        return self._backend.ready(self._clock.now())

    def model(self, key: str | None, name: str, version: str) -> ModelRecord:
        """The registered record of (name, version) for the holder of `key`. PERMISSION_DENIED for a model
        outside the tenant's globs is checked before the name is resolved, so the answer does not tell
        whether such a model exists; then NOT_FOUND for an unknown model or version."""
        tenant = self._keys.authenticate(key)
        TenantDirectory.authorize(tenant, name)
        return self._catalog.resolve(name, version)

    def model_ready(self, record: ModelRecord) -> bool:
        """Whether an accepting worker has this version loaded."""
        return self._backend.serves(record.name, record.version)

    def versions(self, name: str) -> list[str]:
        """Registered versions of a model, oldest first."""
        return self._catalog.versions(name)

    @property
    def tracing(self) -> bool:
        """Whether calls are traced (a transport reads the caller's trace context only then)."""
        return self._tracer is not None

    # -- inference -----------------------------------------------------------------------------------------
    async def infer(self, call: InferCall) -> InferResult:
        """One call, traced when tracing is on (the span's parent is the caller's trace context, if any);
        raises SluiceError. With tracing off no OpenTelemetry call is made: its no-op tracer still cost
        8-14 µs per call here."""
        request_id = loggable_id(call.id)
        if self._tracer is None:
            token = REQUEST_ID.set(request_id)
            try:
                return await self._serve(call)
            finally:
                REQUEST_ID.reset(token)
        attributes = {"sluice.model": call.model_name[:MAX_LOGGED_ID], "sluice.request_id": request_id}
        with self._tracer.start_as_current_span(
            "sluice.infer", context=call.trace_parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            token = REQUEST_ID.set(request_id or f"{span.get_span_context().trace_id:032x}")
            try:
                return await self._serve(call)
            except SluiceError as err:
                span.set_status(Status(StatusCode.ERROR, f"{err.code.name}: {err.message}"))
                raise
            finally:
                REQUEST_ID.reset(token)

    async def _serve(self, call: InferCall) -> InferResult:
        """One call through the data plane, accounted once however it ends."""
        progress = _Progress(self._clock.now())
        try:
            result = await self._run(progress, call)
        except SluiceError as err:
            if progress.claimed is not None:
                await self._idempotency.failed(progress.claimed, err)
            self._count_failure(progress, err)
            raise
        except Exception as exc:  # a bug must end this call with a status, and only this call
            self._bugs.exception("request failed on an unexpected error")
            if progress.claimed is not None:
                await self._idempotency.failed(progress.claimed, None)
            bug = Internal(f"internal error ({type(exc).__name__})", reason="internal")
            self._count_failure(progress, bug)
            raise bug from exc
        except asyncio.CancelledError:
            if progress.claimed is not None:
                await self._idempotency.failed(progress.claimed, None)
            self._metrics.request_outcomes(progress.model, _CANCELLED).inc()
            raise
        finally:
            self._bytes.release(progress.held)
        self._metrics.request_outcomes(progress.model, _OK).inc()
        latency = self._clock.now() - progress.start
        self._metrics.request_latencies(progress.model).observe(latency)
        self._live.record(progress.model, progress.start + latency, latency, good=True)
        return result

    async def _run(self, progress: _Progress, call: InferCall) -> InferResult:
        """The steps in the module's order; `progress` records how far the call got."""
        tenant = self._keys.authenticate(call.api_key)
        progress.tenant = tenant.name
        progress.held += self._hold(call.body_bytes)
        priority = int_parameter(call.parameters, "priority") or 0
        priority = progress.priority = tenant.priority(priority, self._levels)
        # Authorised by name before the name is resolved, so a tenant cannot learn which models and
        # versions exist outside its permissions (the resolved name is the requested one).
        TenantDirectory.authorize(tenant, call.model_name)
        record = version_to_serve(self._catalog, call.model_name, call.model_version, self._backend.serves)
        progress.model = record.name
        decoded = decode_call(call, record, self._limits)
        # What the call holds besides its body: the decoded inputs, the worker's answer and the result.
        progress.held += self._hold(decoded.input_bytes + 2 * decoded.response_bytes)
        deadline = self._budget.deadline(progress.start, call.time_remaining_s, decoded.timeout_s)
        parameters = plain_parameters(call.parameters)
        # What is left now, not since the call began: the wait for a running twin ends at our deadline.
        begun = await self._idempotency.begin(
            tenant.name,
            call,
            decoded=decoded,
            parameters=parameters,
            remaining_s=deadline - self._clock.now(),
        )
        if isinstance(begun, InferResult):
            return begun
        progress.claimed = begun

        lookup = self._cache.lookup(tenant.name, record, decoded, parameters)
        execute = partial(self._execute, record, decoded, deadline, tenant, priority, arrival=progress.start)
        if lookup.use is CacheUse.OFF:
            # Most models are not cacheable: their calls skip the cache gate's coroutine (~1 µs a call).
            result = await execute()
        else:
            result = await self._cache.serve(
                lookup, record, decoded, execute, charge=partial(self._backend.charge, tenant)
            )
            if result.cache is CacheOutcome.HIT:
                self._audit.on_hit(tenant.name, lookup.key, record, decoded, result)
        if progress.claimed is not None:
            await self._idempotency.succeeded(progress.claimed, result)
            progress.claimed = None  # settled: a retry replays it
        late = self._budget.finished_late(deadline, self._clock.now())
        if late is not None:  # the promise is made here, so it is kept here: never OK after the deadline
            raise late
        return result

    async def _execute(
        self,
        record: ModelRecord,
        decoded: DecodedRequest,
        deadline: float,
        tenant: Tenant,
        priority: int,
        *,
        arrival: float,
    ) -> InferResult:
        """Run a decoded request on a worker: the result of the outputs it asked for."""
        reply = await self._backend.infer(decoded, deadline, tenant, priority, arrival=arrival)
        return InferResult(
            model_name=record.name,
            model_version=record.version,
            id=decoded.client_id,
            outputs=requested_outputs(decoded, reply.outputs),
            served=reply.served,
        )

    def _count_failure(self, progress: _Progress, err: SluiceError) -> None:
        now = self._clock.now()
        self._live.record(progress.model, now, now - progress.start, good=False)
        self._metrics.request_outcomes(progress.model, err.code.name).inc()
        self._metrics.rejected(err, progress.tenant, progress.priority)

    def _hold(self, size: int) -> int:
        """Count `size` bytes against the in-flight budget (RESOURCE_EXHAUSTED beyond it)."""
        self._bytes.acquire(size)
        return size
