"""The model in the kit's own process, with no Sluice in the way: the reference answers the correctness
check compares against, and the device's own curve (forward time and items/s by batch size and sequence
bucket), which bounds what any batching server can get from this device.

Inputs are padded exactly as a worker pads them (worker/padding.py, `stack`), so a request the router sends
alone (a batch of one) meets the same shapes, kernels and weights here as on the worker. Times on CUDA come
from CUDA events around `reps` forwards after `warmup` untimed ones (the host clock would time the launch
queue, not the device); on the CPU from the process clock around the same loop.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from sluice_inference.worker.backends.torchscript import for_inference
from sluice_inference.worker.model_config import ModelConfig
from sluice_inference.worker.padding import stack
from sluice_inference.worker.repository import scan_repository

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class CurvePoint:
    """One cell of the device curve."""

    bucket: int
    batch: int
    forward_ms: float
    items_per_s: float


class InProcessModel:
    """One model of the kit's repository, loaded on `device` as its worker loads it (frozen for inference
    unless its config says `freeze: false`: worker/backends/torchscript.py)."""

    def __init__(self, repository: Path, name: str, device: str) -> None:
        [spec] = scan_repository(repository, [name])
        assert spec.artifact is not None  # torchscript models have one
        self.config: ModelConfig = spec.config
        self.device = torch.device(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load: see worker/backends
            self.module: Any = torch.jit.load(  # type: ignore[no-untyped-call]
                str(spec.artifact), map_location=self.device
            )
        self.module.eval()
        if self.config.freeze:
            self.module = for_inference(self.module, spec.artifact)

    def forward(self, rows: list[Array]) -> Array:
        """The pooled outputs of `rows` (each [1, L] token ids) stacked and padded as a worker does."""
        arrays, mask = stack(self.config, [{"tokens": row} for row in rows])
        assert mask is not None  # the encoder configs declare a mask input
        with torch.inference_mode():
            out = self.module(
                tokens=torch.from_numpy(arrays["tokens"]).to(self.device),
                mask=torch.from_numpy(mask).to(self.device),
            )
        return np.asarray(out.cpu().numpy())


def batch_sizes(max_batch: int) -> list[int]:
    """Powers of two up to `max_batch`, and `max_batch` itself."""
    sizes = [1 << k for k in range(max_batch.bit_length()) if 1 << k <= max_batch]
    return sorted({*sizes, max_batch})


def time_forward(model: InProcessModel, batch: int, length: int, warmup: int, reps: int) -> float:
    """Mean seconds per forward of `batch` rows of `length` tokens (no padding), after `warmup` forwards."""
    high = model.config.inputs[0].range[1] if model.config.inputs[0].range else 100
    tokens = torch.randint(1, high, (batch, length), device=model.device)
    mask = torch.ones(batch, length, device=model.device)
    cuda = model.device.type == "cuda"
    with torch.inference_mode():
        for _ in range(warmup):
            model.module(tokens=tokens, mask=mask)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(reps):
                model.module(tokens=tokens, mask=mask)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000.0 / reps
        began = time.process_time()
        for _ in range(reps):
            model.module(tokens=tokens, mask=mask)
        return (time.process_time() - began) / reps


def device_curve(
    model: InProcessModel, warmup: int, reps: int, left_s: Callable[[], float]
) -> list[CurvePoint]:
    """Forward time and items/s for every bucket and batch size, shortest first, until `left_s()` runs
    out (a cut-short curve keeps the cells measured so far)."""
    points: list[CurvePoint] = []
    for bucket in model.config.batching.buckets["tokens"]:
        for batch in batch_sizes(model.config.max_batch_size):
            if left_s() <= 0:
                return points
            seconds = time_forward(model, batch, bucket, warmup, reps)
            points.append(CurvePoint(bucket, batch, seconds * 1000.0, batch / seconds))
    return points


def bound_at(points: list[CurvePoint], bucket: int, batch: float) -> float | None:
    """In-process items/s at `bucket` for a mean batch of `batch` rows, interpolated linearly in batch
    size between measured cells (None when the bucket was not measured)."""
    cells = sorted((p.batch, p.items_per_s) for p in points if p.bucket == bucket)
    if not cells:
        return None
    sizes = [size for size, _ in cells]
    rates = [rate for _, rate in cells]
    return float(np.interp(batch, sizes, rates))
