"""The router's Prometheus metrics (names `sluice_router_*`, base units: seconds, rows)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS


class RouterMetrics:
    """Every metric the router exports, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sluice_router_requests", "Inference requests by model and final status code",
            ["model", "code"], registry=r,
        )  # fmt: skip
        self.request_latency = Histogram(
            "sluice_router_request_duration_seconds", "End-to-end latency of successful requests",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "sluice_router_queue_wait_seconds", "Time from admission until the request's batch was sent",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "sluice_router_batch_size", "Rows per batch sent to workers",
            ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.execute = Histogram(
            "sluice_router_execute_seconds", "Forward-pass time of batches, as reported by workers",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "sluice_router_queue_depth", "Requests waiting in lanes", registry=r,
        )  # fmt: skip
        self.in_flight_batches = Gauge(
            "sluice_router_in_flight_batches", "Batches sent to workers and not yet answered", registry=r,
        )  # fmt: skip
        self.workers = Gauge(
            "sluice_router_workers", "Workers known from etcd, by whether they accept batches",
            ["accepting"], registry=r,
        )  # fmt: skip
