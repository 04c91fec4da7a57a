"""The worker's Prometheus metrics (names `sluice_worker_*`, base units: seconds, rows)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sluice_inference.common.metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS


class WorkerMetrics:
    """Every metric a worker exports, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batches = Counter(
            "sluice_worker_batches", "Router batches executed (merged ones counted each)", ["model"],
            registry=r,
        )  # fmt: skip
        self.items = Counter(
            "sluice_worker_items", "Items answered, by status code", ["model", "code"], registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "sluice_worker_batch_size", "Rows per forward pass (batches merged into it together)",
            ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.execute = Histogram(
            "sluice_worker_execute_seconds", "Time per forward pass (staging and transfers included)",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "sluice_worker_queue_wait_seconds", "Time a batch waited on the worker before executing",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.refused = Counter(
            "sluice_worker_refused_batches", "Batches answered unexecuted, by reason (worker_busy: full)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.queued_batches = Gauge(
            "sluice_worker_queued_batches", "Batches accepted and not yet answered", registry=r,
        )  # fmt: skip
        self.gpu_utilization = Gauge(
            "sluice_worker_gpu_utilization_ratio", "GPU utilisation from NVML (CUDA workers only)",
            registry=r,
        )  # fmt: skip
        self.gpu_memory_used = Gauge(
            "sluice_worker_gpu_memory_used_bytes", "GPU memory in use from NVML (CUDA workers only)",
            registry=r,
        )  # fmt: skip
        self.etcd_up = Gauge(
            "sluice_etcd_session_up", "1 while this process's etcd lease is kept alive", registry=r,
        )  # fmt: skip
        self.busy_ratio = Gauge(
            "sluice_worker_busy_ratio", "Fraction of recent wall time spent executing batches", registry=r,
        )  # fmt: skip
