"""The worker's Prometheus metrics (names `sluice_worker_*`, base units: seconds, rows)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sluice_inference.common.errors import Code
from sluice_inference.common.metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS


class ModelMetrics:
    """One model's metric children, bound once: a `labels()` lookup costs several µs, and the runner
    observes a handful per batch."""

    def __init__(self, metrics: WorkerMetrics, model: str) -> None:
        self.batches = metrics.batches.labels(model)
        self.batch_size = metrics.batch_size.labels(model)
        self.execute = metrics.execute.labels(model)
        self.queue_wait = metrics.queue_wait.labels(model)
        self._items = metrics.items
        self._model = model
        self._by_code: dict[int, Counter] = {}

    def items(self, code: int) -> Counter:
        """The items counter for a status code (gRPC codes: a bounded set)."""
        child = self._by_code.get(code)
        if child is None:
            name = Code(code).name if code in Code._value2member_map_ else str(code)
            child = self._by_code[code] = self._items.labels(self._model, name)
        return child


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
        self._models: dict[str, ModelMetrics] = {}

    def model(self, label: str) -> ModelMetrics:
        """The children of one model label (the caller bounds the labels: models served, or one other)."""
        bound = self._models.get(label)
        if bound is None:
            bound = self._models[label] = ModelMetrics(self, label)
        return bound
