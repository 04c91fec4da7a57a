"""GPU utilisation and memory of a CUDA worker's device, through NVML (the `gpu` extra: nvidia-ml-py).

Absent NVML (a CPU worker, or the extra not installed), `GpuSampler.create` returns None and nothing is
exported: CPU workers report their busy fraction only. NVML numbers are the device's, not this process's:
several workers sharing one GPU all see the same utilisation.
"""

from __future__ import annotations

import logging
from typing import Any

from sluice_inference.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class GpuSampler:
    """Reads NVML for one device index and sets the worker's GPU gauges."""

    def __init__(self, nvml: Any, handle: Any, metrics: WorkerMetrics) -> None:
        self._nvml = nvml
        self._handle = handle
        self._metrics = metrics

    @classmethod
    def create(cls, device: str, metrics: WorkerMetrics) -> GpuSampler | None:
        """A sampler for `cuda:N`, or None on CPU or without NVML."""
        if not device.startswith("cuda:"):
            return None
        try:
            import pynvml
        except ImportError:
            log.warning("nvidia-ml-py is not installed (extra `gpu`): no GPU utilisation metrics")
            return None
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(device.split(":", 1)[1]))
        except pynvml.NVMLError as exc:
            log.warning("NVML unavailable (%s): no GPU utilisation metrics", exc)
            return None
        return cls(pynvml, handle, metrics)

    def sample(self) -> None:
        """Set utilisation (0-1) and memory used (bytes) from NVML."""
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except self._nvml.NVMLError as exc:
            log.warning("NVML read failed: %s", exc)
            return
        self._metrics.gpu_utilization.set(rates.gpu / 100.0)
        self._metrics.gpu_memory_used.set(memory.used)
