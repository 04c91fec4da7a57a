"""What the router's own CPU costs per batch and per row, fitted from what it spent (docs/batching.md, "The
router's own CPU").

The adaptive batcher fills batches while the router's CPU is the constraint, using h (CPU per batch: cut,
frame, send, take the answer apart) and c (CPU per row: receive, decode, admit, answer). Neither can be
timed directly without costing what it measures, so the status pass reports, once a second, the process's
CPU time and how many batches and rows it dispatched meanwhile, and this fit solves CPU = h·batches +
c·rows by least squares over the last `WINDOW` intervals. It needs intervals whose rows per batch
differ; while they do not (a steady batch size) the split is unknown and the previous estimate stands.
Pure: no clock and no I/O, the shell feeds it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 20
"""Intervals the fit looks back over (the status pass adds one a second)."""
MIN_SPREAD = 0.02
"""The fit is taken only when the intervals' rows per batch vary by this much (relative determinant of
the normal equations); below it, h and c cannot be told apart and a noisy split would swing the target."""
MAX_COST_S = 1.0
"""No estimate above this is believed (the core refuses one too): it is a measuring error."""


@dataclass(frozen=True)
class HostCostEstimate:
    """The router's CPU per batch and per row, in seconds."""

    batch_s: float
    row_s: float


class HostCostFit:
    """CPU = h·batches + c·rows over the last `WINDOW` intervals, h and c non-negative."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=window)
        self.estimate: HostCostEstimate | None = None
        """The latest fit (None until the intervals have varied enough to give one)."""

    def add(self, cpu_s: float, batches: int, rows: int) -> HostCostEstimate | None:
        """One interval's CPU seconds and the batches and rows dispatched in it; returns the estimate in
        force afterwards. An interval with no batches says nothing about either cost and is skipped."""
        if batches <= 0 or rows < batches or cpu_s < 0.0:
            return self.estimate
        self._samples.append((cpu_s, batches, rows))
        fitted = _least_squares(self._samples)
        if fitted is not None:
            self.estimate = fitted
        return self.estimate


def _least_squares(samples: deque[tuple[float, int, int]]) -> HostCostEstimate | None:
    sbb = sum(b * b for _, b, _ in samples)
    srr = sum(r * r for _, _, r in samples)
    sbr = sum(b * r for _, b, r in samples)
    scb = sum(c * b for c, b, _ in samples)
    scr = sum(c * r for c, _, r in samples)
    det = sbb * srr - sbr * sbr
    if len(samples) < 3 or det <= MIN_SPREAD * sbb * srr:
        return None
    h = (scb * srr - scr * sbr) / det
    c = (scr * sbb - scb * sbr) / det
    if h < 0.0:  # the data say no per-batch cost: all of it per row
        h, c = 0.0, scr / srr
    elif c < 0.0:
        h, c = scb / sbb, 0.0
    if h > MAX_COST_S or c > MAX_COST_S:
        return None
    return HostCostEstimate(batch_s=h, row_s=c)
