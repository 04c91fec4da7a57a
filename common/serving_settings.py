"""What a router and a worker do, and the policy they apply: the router's ports and limits, a worker's
device and capacity, tenants and their quotas, admission, the result cache, idempotency records and the
autoscaling signal. Each field's docstring is its documentation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sluice_inference.common.config_rules import Section, check_key_hashes
from sluice_inference.common.trust_settings import ServerTlsSettings


class RouterSettings(Section):
    """The stateless front end."""

    listen: str = "0.0.0.0:8001"
    """gRPC address for clients (KServe v2, health, reflection, admin)."""
    metrics_port: int = Field(default=8002, ge=0, le=65535)
    """Prometheus /metrics port (0: pick a free one)."""
    router_id: str = ""
    """Name in etcd and logs; empty: hostname-pid."""
    batches_in_flight_per_worker: int = Field(default=0, ge=0, le=64)
    """Batches this router keeps on one worker at once; 0 (the default): by the worker's device, 1 on a CPU
    (a second batch in flight overlaps nothing there: the forward and the hop share the host's cores, so it
    only halved the batches and added a message each way: docs/performance.md, "The second sitting of
    2026-12-01"), 2 on an accelerator (the next batch's transfer overlaps the current compute). Set 2 for
    CPU workers on nodes of their own whose network round trip is a sizeable part of a forward."""
    default_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline for requests that carry neither a gRPC deadline nor parameters["timeout"]."""
    max_timeout_s: float = Field(default=300.0, gt=0)
    """Longest deadline a request may have: a longer `parameters["timeout"]` or gRPC deadline is shortened
    to it (a request may only shorten the server's limit; router/policy/deadline_budget.py)."""
    max_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest request or response message on the client port; a request whose response would be larger
    (rows x outputs x bytes) is refused before any work. Every concurrent read may hold this much."""
    max_inflight_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    """Budget for the bytes of requests being served (their bodies plus their expected responses): a
    request that would exceed it is refused with RESOURCE_EXHAUSTED and a retry hint."""
    stream_max_inflight: int = Field(default=64, ge=1, le=10_000)
    """Requests of one `ModelStreamInfer` stream served at once; the router stops reading the stream
    (backpressure) until one of them has been answered."""
    tenant_max_receives: int = Field(default=2, ge=1, le=1024)
    """`ModelInfer` bodies one tenant may have arriving at once. More calls of the tenant wait, unread, for
    up to `RECEIVE_SLOT_WAIT_S` (router/receive_gate.py), then are refused RESOURCE_EXHAUSTED with a retry
    hint: slow uploads hold at most this many bodies of `max_message_bytes` per tenant."""
    tenant_max_streams: int = Field(default=2, ge=1, le=1024)
    """`ModelStreamInfer` streams one tenant may have open at once (each may be receiving one message);
    more are refused RESOURCE_EXHAUSTED with a retry hint before anything of them is read."""
    receive_timeout_s: float = Field(default=30.0, gt=0)
    """A `ModelInfer` body must have arrived this long after the call did (waiting for a receive slot
    included); a slower one is refused DEADLINE_EXCEEDED and its bytes are let go."""
    max_concurrent_streams: int = Field(default=1024, ge=1, le=65_536)
    """HTTP/2 streams (calls) one client connection may have open at once on the client port
    (`grpc.max_concurrent_streams`); a client queues the calls beyond it once it has the router's
    settings, and a call opened beyond it before then fails UNAVAILABLE (REFUSED_STREAM). gRPC clients
    share one connection per target across channels, so keep it above a client's burst."""
    watchdog_s: float = Field(default=5.0, gt=0)
    """A decision loop that has not ticked for this long is declared stuck: what it held is failed and
    health turns NOT_SERVING, so the orchestrator restarts the router."""
    worker_hang_s: float = Field(default=5.0, gt=0)
    """A worker that holds batches and answers none for this long (or 10x the estimate of what it holds,
    if longer) is treated as dead: its requests are re-dispatched and its stream is closed."""
    door_max_delay_ms: float = Field(default=250.0, ge=0)
    """The front door (router/policy/door.py): once calls have waited longer than this before the
    router's code runs for `door_sustain_s`, part of the new inference requests are refused UNAVAILABLE
    with a retry hint before they are parsed, lowest tenant `default_priority` first, so a router whose own
    CPU is the limit keeps serving what it admits in time. While a higher priority level is protected,
    half of this is the wait that cuts (its calls still wait for their batch after the door). Set it
    below the latency you promise (the peer benchmark uses 30 ms for a 50 ms SLO); 0 turns it off."""
    door_sustain_s: float = Field(default=1.0, ge=0)
    """How long the wait must exceed `door_max_delay_ms` before the door first refuses anything: bursts
    that drain and closed-loop clients' standing queues are served."""
    pressure_hold_factor: float = Field(default=5.0, ge=1.0, le=10.0)
    """While the router's own CPU is short, how far past a model's `batching.max_wait_ms` a lane may hold
    its oldest request for a fuller batch: the hold grows with the CPU pressure of the router's event loop,
    from none at 0.5 to this many times `max_wait_ms` at 0.9 (docs/batching.md). A saturated router's calls
    already wait for it before its code runs, as Triton's requests wait for a busy model instance past
    `max_queue_delay_microseconds`; fewer, fuller batches leave it more CPU for them (on one core shared
    with its worker, 5 held the SLO at 1,300-1,500 req/s in 8 of 12 runs, 3 in 2: docs/performance.md,
    2026-12-03). 1 keeps every hold within `max_wait_ms`; a model with `max_wait_ms: 0` is never held;
    budgets still cut."""
    batcher: Literal["adaptive", "timer"] = "adaptive"
    """`adaptive`: batch size from the latency model and arrival rate; `timer`: the classic fixed
    max_batch_size + max_wait (Triton's dynamic batcher), kept for comparison."""
    scheduler: Literal["expected_completion", "least_loaded", "round_robin"] = "expected_completion"
    """How a batch picks its worker (router/policy/scheduler.py)."""
    tls: ServerTlsSettings = ServerTlsSettings()
    """TLS (optionally mTLS) on the client port."""
    admin_keys: list[str] = []
    """SHA-256 of each admin key (`sha256:<hex>`, `sluice keys hash KEY`): keys that may call
    `sluice.v1.RouterAdmin` without being any tenant's. A tenant with `admin: true` may too. With no
    admin key, no tenant key and `admission.require_api_key` false (key-less local mode), admin is open."""

    @field_validator("admin_keys")
    @classmethod
    def _admin_keys_hashed(cls, value: list[str]) -> list[str]:
        return check_key_hashes(value)

    @model_validator(mode="after")
    def _timeouts_agree(self) -> RouterSettings:
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s must not exceed max_timeout_s")
        return self


class WorkerSettings(Section):
    """A process that owns one device."""

    repository: Path = Path("models")
    """Model repository root (models/<name>/config.yaml, models/<name>/<version>/...)."""
    models: list[str] = []
    """Names of models to load; empty: every model in the repository."""
    device: str = "cpu"
    """`cpu` or `cuda:N`."""
    torch_threads: int = Field(default=1, ge=1, le=256)
    """Intra-op threads for torch; 1 keeps latency steady on small shared machines."""
    listen: str = "127.0.0.1:0"
    """gRPC bind address; port 0 picks a free port, and the worker registers the one it got."""
    advertise_host: str = "127.0.0.1"
    """Host routers should dial (the pod IP in Kubernetes)."""
    worker_id: str = ""
    """Name in etcd; empty: hostname-pid."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Prometheus /metrics port (0: pick a free one)."""
    capacity: int = Field(default=4, ge=1, le=64)
    """Batches this worker holds at once (waiting or running), across all routers' streams. A batch
    arriving beyond it is answered at once, never run: every item UNAVAILABLE with reason `worker_busy`,
    not the worker's fault, for the router to place elsewhere. Published in the worker's etcd record;
    routers keep each worker's queue within it using the load on every answer. Batches waiting together
    for the same model and shape run as one forward, so what a full queue costs a new batch is about one
    merged forward plus the running one. 4: one running plus one waiting for each of up to 3 routers
    sending at once, so the device never idles between forwards while every router has its next batch
    there (docs/operations.md, "Worker capacity"; figures in docs/benchmarks.md)."""
    drain_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a drain waits for in-flight batches before exiting anyway."""
    idle_report_interval_s: float = Field(default=1.0, ge=0.25, le=5.0)
    """How often a worker with no batches reports its load to the routers (its heartbeat); every 0.25 s
    while it holds any. A router closes an idle worker's stream after this plus 0.55 s of silence, and a
    busy one's 0.8 s after its last message or batch sent (common/heartbeat.py). 0.25: never slower."""
    dev: bool = False
    """Development mode (`sluice worker --dev`): accept the cluster token that deploy/overlays/dev
    publishes (common/dev_token.py). Anywhere reachable by others, leave it off: that token is public."""
    forward_on_loop: bool = False
    """Run forwards on the worker's event loop instead of its device thread: no thread hand-off per
    forward in either direction (worker/device_thread.py), which saves CPU per batch for small models on
    a CPU shared with the router (docs/performance.md, "The hop"). A forward then holds up the worker's
    stream I/O and load reports for its whole duration, so only for models whose forwards stay far under
    the routers' 0.8 s heartbeat; never worth it on CUDA, where the thread overlaps the loop's work with
    the device's."""
    synthetic_slowdown: float = Field(default=1.0, gt=0)
    """Multiplies the simulated latency of `synthetic` models: makes this worker a slower device in
    scheduling tests and benchmarks. No effect on real models."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value != "cpu" and not (value.startswith("cuda:") and value[5:].isdigit()):
            raise ValueError("must be 'cpu' or 'cuda:N'")
        return value


ANONYMOUS_TENANT = "anonymous"


class TenantSettings(Section):
    """One tenant's identity and quotas (docs/design.md §8). Priorities follow Triton: 1 is the highest."""

    api_keys: list[str] = []
    """SHA-256 of each API key, as `sha256:<hex>` (`sluice keys hash KEY` prints one); keys never stored."""
    rate: float = Field(default=100.0, gt=0)
    """Requests per second (token-bucket refill), cluster-wide: shared by the routers as demand arrives."""
    burst: int = Field(default=100, ge=1)
    """Token-bucket size: how many requests may arrive at once above the rate."""
    max_inflight: int = Field(default=64, ge=1)
    """Requests admitted and not yet answered, cluster-wide: shared by the routers as demand arrives."""
    weight: float = Field(default=1.0, gt=0)
    """Fair share within a priority level, relative to the other tenants queued there."""
    default_priority: int = Field(default=2, ge=1)
    """Priority of requests that ask for 0 (or none)."""
    max_priority: int = Field(default=2, ge=1)
    """The best priority this tenant may use; requests asking for better are capped to it. Unset, it is
    `default_priority`: a tenant is granted better than its default only explicitly (with 1 as the
    default for everyone, any tenant could send priority 1 and evict the others' queued work)."""
    models: list[str] = ["*"]
    """Models this tenant may call (glob patterns)."""
    admin: bool = False
    """The admin role: this tenant's keys may also call `sluice.v1.RouterAdmin` (list workers and
    tenants, read stats, purge the cache). Plain tenant keys get PERMISSION_DENIED there."""

    @field_validator("api_keys")
    @classmethod
    def _hashed(cls, value: list[str]) -> list[str]:
        return check_key_hashes(value)

    @model_validator(mode="before")
    @classmethod
    def _no_grant_by_default(cls, data: object) -> object:
        if isinstance(data, dict) and "max_priority" not in data and "default_priority" in data:
            return {**data, "max_priority": data["default_priority"]}
        return data

    @model_validator(mode="after")
    def _priorities_agree(self) -> TenantSettings:
        if self.default_priority < self.max_priority:
            raise ValueError("default_priority must not be better (lower) than max_priority")
        return self


class AdmissionSettings(Section):
    """Admission and overload control: bounds, the global quota, anti-starvation."""

    enabled: bool = True
    """False turns every check off (a plain unbounded FIFO): only for baseline comparisons."""
    global_rate: float | None = Field(default=None, gt=0)
    """Requests per second for the whole cluster, shared by the routers as demand arrives; unset: none."""
    global_burst: int = Field(default=1000, ge=1)
    """Bucket size of the global limit."""
    lane_max_queued: int = Field(default=1000, ge=1)
    """Most requests one lane (model, version, shape) may hold queued."""
    max_queued_bytes: int = Field(default=128 * 1024 * 1024, ge=1024)
    """Most input bytes all lanes together may hold queued (part of `router.max_inflight_bytes`)."""
    aging_s: float = Field(default=2.0, gt=0)
    """A queued request competes one priority level higher per `aging_s` waited, so low priorities never
    starve."""
    estimate_margin: float = Field(default=1.2, ge=1.0)
    """Safety factor on learned execution-time estimates when judging whether a deadline can be met."""
    require_api_key: bool = False
    """Refuse requests without a key even when an `anonymous` tenant is configured."""
    priority_levels: int = Field(default=10, ge=1, le=1000)
    """Priority levels (1 is the highest, as in Triton): `parameters["priority"]` outside 0..levels is
    INVALID_ARGUMENT, and tenants' default and max priorities must lie within them."""
    quota_shares: Literal["demand", "equal"] = "demand"
    """How routers split cluster-wide quotas: `demand` — each router's share of a tenant's rate, burst and
    in-flight cap (and of the global rate) follows where that tenant's requests arrive, published through
    etcd; `equal` — 1/N each for N live routers (exact only when clients spread evenly)."""
    share_floor: float = Field(default=0.1, ge=0.0, le=1.0)
    """ε: no router's share falls below ε/N of a limit, so a router admits a tenant's first requests at
    once; the shares of all routers then add up to at most (1 + ε) x the limit."""
    max_routers: int = Field(default=100, ge=1, le=10_000)
    """The most routers this cluster runs. Shares count at most this many (this router included), however
    many records `routers/` holds, so records written by someone else cannot push this router's
    fraction of a limit below `share_floor / max_routers` (nor the equal split below 1 / max_routers).
    Set it to the largest router count you deploy: above it, shares are computed as if there were this
    many routers, and the routers together may admit up to (live routers / max_routers) x the limit."""
    demand_window_s: float = Field(default=0.5, gt=0.0, le=60.0)
    """Time constant of the decaying request rate each router publishes as its demand: shares follow a
    move of the load within about two of these, plus two publish intervals."""
    demand_publish_s: float = Field(default=0.25, ge=0.05, le=60.0)
    """Least time between two demand publishes of one router (stretched to N/100 s with N routers, so the
    cluster writes at most 100 records a second); a router republishes only when its demand moved by
    more than 20 %."""


class CacheSettings(Section):
    """The result cache (only for models declaring `deterministic: true` and `cache: enabled`)."""

    enabled: bool = True
    """Master switch for this router."""
    memory_bytes: int = Field(default=128 * 1024 * 1024, ge=0)
    """Tier 1: this router's in-memory LRU, bounded in bytes."""
    ttl_s: float = Field(default=3600.0, gt=0)
    """How long an entry lives (both tiers)."""
    audit_fraction: float = Field(default=0.01, ge=0, le=1)
    """Share of hits recomputed on a worker at the lowest priority and compared with the cached outputs
    (within each tenant's audit budget: `audit_rate`, `audit_burst`)."""
    audit_tolerance: float = Field(default=1e-5, ge=0)
    """Absolute floor of the audit tolerance for floating-point outputs: a difference this small always
    passes. Above it, the tolerance is relative to the output's magnitude: `audit_margin` times the
    model version's measured batch-vs-single deviation (docs/caching.md, "Audits")."""
    audit_margin: float = Field(default=8.0, ge=1, le=1000)
    """How many times the model version's measured relative batch-vs-single deviation (at least the output
    dtype's epsilon) a cached output may differ from a fresh run, relative to the output's largest
    magnitude. Float kernels round differently for different batch sizes (the demo MLP: up to ~9 epsilon),
    and the batch an entry came from is unknown, hence the margin."""
    audit_rate: float = Field(default=0.5, gt=0, le=1000)
    """Audits per second each tenant's hits may cause on this router (a token bucket): an audit is one or
    two executions on a worker that the tenant's rate limit does not pay for."""
    audit_burst: int = Field(default=2, ge=1, le=1000)
    """Bucket size of `audit_rate`."""
    audit_max_inflight: int = Field(default=4, ge=1, le=1000)
    """Audits running at once on this router, all tenants together; sampled hits beyond it go unaudited."""
    audit_strikes: int = Field(default=3, ge=1, le=1000)
    """Audit mismatches of one tenant's hits for one model (within `audit_ban_s`) after which that
    tenant's requests to that model bypass the cache on this router."""
    audit_ban_s: float = Field(default=3600.0, gt=0)
    """How long such a bypass lasts, and how long a mismatch counts towards it."""


class IdempotencySettings(Section):
    """Idempotency-key records."""

    ttl_s: float = Field(default=86_400.0, gt=0)
    """How long a completed call is replayed."""
    max_records: int = Field(default=100_000, ge=1)
    """Bound on in-process records (Redis evicts by TTL)."""
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Bound on the bytes of in-process records (stored responses included); when full, the tenant holding
    the most loses its oldest record first, so each active tenant keeps a fair share."""


class AutoscaleSettings(Section):
    """The `desired_workers` signal (router/policy/autoscale.py has the math)."""

    target_utilization: float = Field(default=0.7, gt=0, le=1)
    """Busy fraction each worker should run at; the rest absorbs bursts."""
    slo_attainment: float = Field(default=0.99, gt=0, le=1)
    """Below this share of requests answered OK within deadline, ask for one more worker."""
    scale_down_window_s: float = Field(default=120.0, ge=0)
    """A lower target must hold this long before it is exported (scale-up is immediate)."""
    min_workers: int = Field(default=1, ge=0)
    """Floor while a model has traffic."""
    max_workers: int = Field(default=1000, ge=1)
    """Ceiling."""
