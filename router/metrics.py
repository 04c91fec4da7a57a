"""The router's Prometheus metrics (names `sluice_router_*`, base units: seconds, rows)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from sluice_inference.common.errors import SluiceError
from sluice_inference.common.loop_metrics import LoopCounter, LoopHistogram
from sluice_inference.common.metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS, Bound

UNKNOWN_TENANT = "unknown"
"""Label for requests rejected before their tenant was known (missing or unknown key)."""
OTHER = "other"
"""Label for any value outside a label's bounded set: a client can never mint new series."""


class RouterMetrics:
    """Every metric the router exports, on a registry of its own.

    Label values come only from bounded sets: configured tenants, registered models, priority levels
    1..`priority_levels`, reasons and codes named in code; anything else is `other`. The metrics updated
    per request or per batch are common/loop_metrics.py's, updated on the router's event loop only.
    """

    def __init__(self, priority_levels: int = 10) -> None:
        self.priority_levels = priority_levels
        self.tenants: frozenset[str] = frozenset()
        """Configured tenant names (kept current by the router as configuration changes)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = LoopCounter(
            "sluice_router_requests", "Inference requests by model and final status code",
            ["model", "code"], registry=r,
        )  # fmt: skip
        self.request_latency = LoopHistogram(
            "sluice_router_request_duration_seconds", "End-to-end latency of successful requests",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = LoopHistogram(
            "sluice_router_queue_wait_seconds", "Time from admission until the request's batch was sent",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = LoopHistogram(
            "sluice_router_batch_size", "Rows per batch sent to workers",
            ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_fill = LoopHistogram(
            "sluice_router_batch_fill_ratio", "Rows per batch over the model's max batch size",
            ["model"], buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0), registry=r,
        )  # fmt: skip
        self.estimate_error = LoopHistogram(
            "sluice_router_estimate_error_ratio",
            "Observed batch service time over the estimate used to schedule it, minus one (0 = exact)",
            ["model"], buckets=(-0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0), registry=r,
        )  # fmt: skip
        self.etcd_up = Gauge(
            "sluice_etcd_session_up", "1 while this process's etcd lease is kept alive", registry=r,
        )  # fmt: skip
        self.watch_up = Gauge(
            "sluice_router_etcd_watch_up",
            "1 while the etcd prefix is being applied (0: its consumer failed and is starting over)",
            ["prefix"], registry=r,
        )  # fmt: skip
        self.watch_restarts = Counter(
            "sluice_router_etcd_watch_restarts", "Times the prefix's consumer failed and was started over",
            ["prefix"], registry=r,
        )  # fmt: skip
        self.watch_skipped = Counter(
            "sluice_router_etcd_values_skipped", "Values under the prefix skipped as too large to read",
            ["prefix"], registry=r,
        )  # fmt: skip
        self.execute = LoopHistogram(
            "sluice_router_execute_seconds", "Forward-pass time of batches, as reported by workers",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "sluice_router_queue_depth", "Requests waiting in lanes", registry=r,
        )  # fmt: skip
        self.in_flight_batches = Gauge(
            "sluice_router_in_flight_batches", "Batches sent to workers and not yet answered", registry=r,
        )  # fmt: skip
        self.admissions = LoopCounter(
            "sluice_router_admissions", "Requests admitted into a queue",
            ["tenant", "priority"], registry=r,
        )  # fmt: skip
        self.rejections = LoopCounter(
            "sluice_router_rejections", "Requests refused, shed or expired before a result, by reason",
            ["reason", "code", "tenant", "priority"], registry=r,
        )  # fmt: skip
        self.shed = LoopCounter(
            "sluice_router_shed", "Queued requests evicted to make room for higher-priority work",
            ["tenant", "priority"], registry=r,
        )  # fmt: skip
        self.lane_depth = Gauge(
            "sluice_router_lane_depth", "Requests queued per model version", ["model", "version"], registry=r,
        )  # fmt: skip
        self.lane_oldest_age = Gauge(
            "sluice_router_lane_oldest_age_seconds", "Age of the oldest queued request per model version",
            ["model", "version"], registry=r,
        )  # fmt: skip
        self.queued_bytes = Gauge(
            "sluice_router_queued_bytes", "Input bytes held by all queues", registry=r,
        )  # fmt: skip
        self.inflight_bytes = Gauge(
            "sluice_router_inflight_bytes", "Bytes held for requests being served (bodies and expected "
            "responses) and answers not yet written, against router.max_inflight_bytes", registry=r,
        )  # fmt: skip
        self.token_level = Gauge(
            "sluice_router_token_bucket_level", "Tokens left in this router's share of a rate limit "
            "(tenant '*' is the global limit)", ["tenant"], registry=r,
        )  # fmt: skip
        self.routers = Gauge(
            "sluice_router_peers", "Live routers sharing the cluster-wide quotas", registry=r,
        )  # fmt: skip
        self.quota_share = Gauge(
            "sluice_router_quota_share", "Fraction of a tenant's cluster-wide limits this router enforces "
            "(tenant '*' is the global limit)", ["tenant"], registry=r,
        )  # fmt: skip
        self.cache = LoopCounter(
            "sluice_cache_requests", "Result-cache outcomes by model (hit, miss, bypass)",
            ["model", "outcome"], registry=r,
        )  # fmt: skip
        self.cache_audits = LoopCounter(
            "sluice_cache_audits", "Audits of cache hits by outcome (match, mismatch, skipped_<reason>)",
            ["model", "outcome"], registry=r,
        )  # fmt: skip
        self.cache_audit_mismatches = Counter(
            "sluice_cache_audit_mismatches", "Cache audits that found a wrong entry, by model and the tenant "
            "whose hit was audited (the entry is purged; repeated ones make that tenant bypass the cache)",
            ["model", "tenant"], registry=r,
        )  # fmt: skip
        self.store_integrity_failures = Counter(
            "sluice_router_store_integrity_failures", "Values read from Redis (or memory) not sealed for "
            "their key with the cluster's HMAC key (planted, copied or corrupted): treated as absent",
            ["store"], registry=r,
        )  # fmt: skip
        self.cache_bytes = Gauge(
            "sluice_cache_memory_bytes", "Bytes held by this router's in-memory cache tier", registry=r,
        )  # fmt: skip
        self.cache_evictions = Gauge(
            "sluice_cache_evictions", "Entries evicted from the in-memory tier since start", registry=r,
        )  # fmt: skip
        self.idempotency = LoopCounter(
            "sluice_idempotency_requests", "Idempotency-key outcomes (claimed, replayed, conflict, ...)",
            ["model", "outcome"], registry=r,
        )  # fmt: skip
        self.redis_up = Gauge(
            "sluice_redis_up", "1 while the shared Redis answers (1 when none is configured)", registry=r,
        )  # fmt: skip
        self.desired_workers = Gauge(
            "sluice_autoscaler_desired_workers", "Workers this model needs cluster-wide (router's estimate; "
            "the HPA takes the max over routers)", ["model"], registry=r,
        )  # fmt: skip
        self.redispatched = LoopCounter(
            "sluice_router_redispatched", "Requests sent again to another worker after theirs died mid-batch",
            ["model"], registry=r,
        )  # fmt: skip
        self.call_delay = Gauge(
            "sluice_router_call_delay_seconds", "How long a call waits before the router's code runs (its "
            "own probe's round trip; router CPU saturation)", registry=r,
        )  # fmt: skip
        self.cpu_pressure = Gauge(
            "sluice_router_cpu_pressure", "Share of the time the router's event loop runs or waits to run "
            "(0..1); from 0.5 up, batches are held for fuller ones", registry=r,
        )  # fmt: skip
        self.door_fraction = Gauge(
            "sluice_router_door_admitted_fraction", "Share of new inference requests the front door admits "
            "(1 unless calls wait too long to reach the router's code)", registry=r,
        )  # fmt: skip
        self.door_refused = LoopCounter(
            "sluice_router_door_refused", "Inference requests refused at the front door, before parsing, "
            "while calls waited too long to reach the router's code, by the priority level of the caller's "
            "tenant", ["priority"], registry=r,
        )  # fmt: skip
        self.workers = Gauge(
            "sluice_router_workers", "Workers known from etcd, by whether they accept batches",
            ["accepting"], registry=r,
        )  # fmt: skip

        # Children bound once per label values, for the metrics updated per request (common/metrics.py).
        self.request_outcomes = Bound(self.requests)
        self.request_latencies = Bound(self.request_latency)
        self.rejection_counts = Bound(self.rejections)
        self.door_refusals = Bound(self.door_refused)
        self.admitted = Bound(self.admissions)

    def tenant_label(self, tenant: str) -> str:
        """A configured tenant's name, `unknown` before authentication, else `other`."""
        if not tenant:
            return UNKNOWN_TENANT
        return tenant if tenant in self.tenants else OTHER

    def priority_label(self, priority: int | None) -> str:
        """A priority level 1..levels, `none` before it was known, else `other` (e.g. cache audits)."""
        if priority is None:
            return "none"
        return str(priority) if 1 <= priority <= self.priority_levels else OTHER

    def rejected(self, error: SluiceError, tenant: str, priority: int | None) -> None:
        """Count a request that ended without a result (refused, shed, expired, failed)."""
        self.rejection_counts(
            error.reason, error.code.name, self.tenant_label(tenant), self.priority_label(priority)
        ).inc()
