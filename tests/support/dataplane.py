"""Fakes of the data plane's seams and a builder that wires a real `DataPlane` around them.

Everything but the driver is real: the catalog, the tenant directory, the in-flight byte budget, the cache
gate over an in-process `ResultCacheStore`, the idempotency gate over an `InProcessIdempotencyStore`.
`FakeBackend` stands in for the driver (a seam: `sluice_inference.router.dataplane.Backend`): it answers at
once, by a rule a test can predict, and records what it was asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.records import ModelRecord, TensorSpec, WorkerRecord
from sluice_inference.common.serving_settings import (
    ANONYMOUS_TENANT,
    CacheSettings,
    IdempotencySettings,
    RouterSettings,
    TenantSettings,
)
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.calls import InferCall, InferResult, InputTensor, ServedBy, Tensor
from sluice_inference.router.codec import DecodedRequest
from sluice_inference.router.dataplane import DataPlane
from sluice_inference.router.idempotency_gate import IdempotencyGate
from sluice_inference.router.live_stats import LiveStats
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.budget import ByteBudget
from sluice_inference.router.policy.catalog import ModelCatalog
from sluice_inference.router.policy.tenants import Tenant, TenantDirectory, hash_api_key
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.router.stores.idempotency_store import InProcessIdempotencyStore

GOLD_KEY = "gold-key"
TENANTS = {
    ANONYMOUS_TENANT: TenantSettings(rate=1e6, burst=10**6, max_inflight=10**6),
    "gold": TenantSettings(api_keys=[hash_api_key(GOLD_KEY)], rate=1e6, burst=10**6, max_inflight=10**6),
}


def mlp(version: str = "1") -> ModelRecord:
    """A deterministic, cacheable model: x FP32[4] → y FP32[4] (x times its version + 1), s FP32[1] (sum)."""
    return ModelRecord(
        name="mlp",
        version=version,
        digest=f"sha256:mlp-{version}",
        platform="synthetic",
        max_batch_size=8,
        max_wait_s=0.0,
        inputs=(TensorSpec(name="x", datatype="FP32", dims=(4,)),),
        outputs=(
            TensorSpec(name="y", datatype="FP32", dims=(4,)),
            TensorSpec(name="s", datatype="FP32", dims=(1,)),
        ),
        deterministic=True,
        cache=True,
    )


def raw_call(values: Sequence[float], **changes: object) -> InferCall:
    """A key-less call of `mlp` with one row of raw FP32 input; `changes` override any field."""
    data = np.asarray([values], "<f4").tobytes()
    call = InferCall(
        model_name="mlp",
        model_version="",
        id="req",
        inputs=(InputTensor("x", "FP32", (1, len(values)), data=data),),
        outputs=(),
        parameters={},
        api_key=None,
        idempotency_key=None,
        time_remaining_s=None,
        body_bytes=64 + len(data),
    )
    return dataclasses.replace(call, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Reply:
    """What the driver answers (`sluice_inference.router.driver.ItemReply`'s shape)."""

    outputs: list[Tensor]
    served: ServedBy


@dataclass
class FakeBackend:
    """The driver seam: answers every request at once with y = x·(version + 1) and s = Σx, from worker
    "fake-1"; or raises the next error in `errors`. `delay_s` moves the fake clock while it "runs";
    `during` is called with each decoded request while it runs (to look at the router mid-request)."""

    clock: FakeClock
    serving: set[tuple[str, str]] = field(default_factory=set)
    calls: list[DecodedRequest] = field(default_factory=list)
    budgets: list[tuple[float, float]] = field(default_factory=list)
    """(arrival, deadline) of each request, as the data plane handed them over."""
    errors: list[Exception] = field(default_factory=list)
    delay_s: float = 0.0
    during: Callable[[DecodedRequest], None] | None = None
    charged: list[str] = field(default_factory=list)
    """Tenants charged a rate token for a request the cache answered."""
    charge_errors: list[Exception] = field(default_factory=list)
    """Raised, in order, by the next charges (e.g. the tenant's rate limit)."""

    async def infer(
        self, decoded: DecodedRequest, deadline: float, tenant: Tenant, priority: int, *, arrival: float
    ) -> Reply:
        """One request's outputs (every output of the model), or the next queued error."""
        self.calls.append(decoded)
        self.budgets.append((arrival, deadline))
        if self.during is not None:
            self.during(decoded)
        if self.errors:
            raise self.errors.pop(0)
        self.clock.advance(self.delay_s)
        x = decoded.inputs[0]
        values = np.frombuffer(x.data, "<f4").reshape(tuple(x.shape))
        factor = int(decoded.record.version) + 1
        y = (values * factor).astype("<f4")
        s = values.sum(axis=1, keepdims=True).astype("<f4")
        outputs = [
            Tensor("y", "FP32", y.shape, y.tobytes()),
            Tensor("s", "FP32", s.shape, s.tobytes()),
        ]
        return Reply(outputs, ServedBy("fake-1", decoded.rows, 0.002))

    def serves(self, model: str, version: str) -> bool:
        """Whether (model, version) is in `serving`."""
        return (model, version) in self.serving

    def charge(self, tenant: Tenant) -> None:
        """Note the charge, or raise the next error in `charge_errors`."""
        if self.charge_errors:
            raise self.charge_errors.pop(0)
        self.charged.append(tenant.name)

    def ready(self, now: float) -> bool:
        """Ready while it serves anything."""
        return bool(self.serving)


@dataclass
class RecordingAudit:
    """The auditor seam: keeps every hit it is handed."""

    hits: list[InferResult] = field(default_factory=list)

    def on_hit(
        self, tenant: str, key: str, record: ModelRecord, decoded: DecodedRequest, cached: InferResult
    ) -> None:
        """Keep the hit."""
        self.hits.append(cached)


@dataclass
class Plane:
    """A real data plane and the parts a test looks at."""

    plane: DataPlane
    backend: FakeBackend
    clock: FakeClock
    catalog: ModelCatalog
    cache: CacheGate
    idempotency: IdempotencyGate
    budget: ByteBudget
    metrics: RouterMetrics
    audit: RecordingAudit

    def roll_out(self, *records: ModelRecord) -> None:
        """Workers now serve exactly these model versions."""
        worker = WorkerRecord(
            worker_id="w1", addr="127.0.0.1:1", device="cpu", models=records, capacity=2, state="ready",
            started_at=0.0,
        )  # fmt: skip
        self.catalog.update({"w1": worker})
        self.backend.serving = {(r.name, r.version) for r in records}

    def requests(self, model: str, code: str) -> float:
        """`sluice_router_requests_total{model, code}`."""
        value = self.metrics.registry.get_sample_value(
            "sluice_router_requests_total", {"model": model, "code": code}
        )
        return value or 0.0


def make_plane(
    *records: ModelRecord,
    tenants: Mapping[str, TenantSettings] = TENANTS,
    inflight_bytes: int = 64 * 1024 * 1024,
    settings: RouterSettings | None = None,
    plane_type: type[DataPlane] = DataPlane,
) -> Plane:
    """A data plane (of `plane_type`: a test may record what it is asked) over `records` (default:
    `mlp("1")`), every collaborator real but the backend."""
    clock = FakeClock(100.0)
    metrics = RouterMetrics()
    backend = FakeBackend(clock)
    cache = CacheGate(
        ResultCacheStore(capacity_bytes=1024 * 1024, ttl_s=60.0, clock=clock), CacheSettings(), metrics
    )
    idempotency = IdempotencyGate(
        InProcessIdempotencyStore(clock=clock), IdempotencySettings(), clock, metrics
    )
    budget = ByteBudget(inflight_bytes)
    catalog = ModelCatalog()
    audit = RecordingAudit()
    directory = TenantDirectory(tenants)
    plane = plane_type(
        backend,
        catalog,
        settings=settings or RouterSettings(),
        metrics=metrics,
        clock=clock,
        tenants=lambda: directory,
        cache=cache,
        idempotency=idempotency,
        audit=audit,
        live=LiveStats(),
        levels=10,
        inflight_bytes=budget,
    )
    made = Plane(plane, backend, clock, catalog, cache, idempotency, budget, metrics, audit)
    made.roll_out(*(records or (mlp("1"),)))
    return made
