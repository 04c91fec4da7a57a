"""Simulated workers: one device each, running one batch at a time, FIFO, like `worker/runner.py`.

Rules (the same as the real runner's):
- batches run one at a time in the order they arrived; a batch sent while one runs waits on the worker
  (the router allows `capacity` in flight, so at most capacity - 1 wait);
- when a batch starts, its items whose deadline has passed are skipped (they come back DEADLINE_EXCEEDED
  and cost no device time); the rest execute together;
- a batch of r executed rows takes (a + c·k·r + overhead) / speed x noise (+ a stall now and then), where
  k is the largest per-item cost among its items (padding: a batch costs as its longest input);
- a crashed worker runs nothing more: its batches never come back, the router must learn of the loss.
The worker draws its noise from its own generator, so adding a worker never changes another's times.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from bench.sim.scenario import ModelSpec, Noise
from router.policy.dispatcher import Dispatch
from router.policy.lanes import QueuedRequest


def class_of(request: QueuedRequest) -> int:
    """The class index the simulator stores as the request's payload."""
    assert isinstance(request.payload, int)
    return request.payload


@dataclass
class Running:
    """The batch on the device: which items it skipped and when it ends."""

    dispatch: Dispatch
    started: float
    ends: float
    executed_rows: int
    skipped: frozenset[int]


@dataclass
class SimWorker:
    """One simulated device."""

    worker_id: str
    speed: float
    model: ModelSpec
    noise: Noise
    item_cost: list[float]
    """Per-item cost of each class; a request's `payload` is its class index (the shell owns payloads)."""
    rng: random.Random
    batch_overhead_s: float = 0.0
    """Per-batch time beyond the profile (calibrated)."""
    alive: bool = True
    draining: bool = False
    running: Running | None = None
    waiting: deque[Dispatch] = field(default_factory=deque)
    batches: int = 0
    rows: int = 0
    busy_s: float = 0.0

    def accept(self, dispatch: Dispatch, now: float) -> Running | None:
        """A batch arrives; returns the batch that started now, if the device was idle."""
        if not self.alive:
            return None  # lost: the router learns it when it notices the crash
        self.waiting.append(dispatch)
        return self._start_next(now) if self.running is None else None

    def finish(self, now: float) -> tuple[Running, Running | None]:
        """The running batch ends at `now`; returns it and the batch that started next, if any."""
        done = self.running
        assert done is not None and math.isclose(done.ends, now)
        self.running = None
        return done, self._start_next(now)

    def crash(self) -> None:
        """The device is gone with everything on it."""
        self.alive = False
        self.running = None
        self.waiting.clear()

    @property
    def idle(self) -> bool:
        """Nothing running or waiting."""
        return self.running is None and not self.waiting

    def _start_next(self, now: float) -> Running | None:
        if not self.waiting:
            return None
        dispatch = self.waiting.popleft()
        live = [r for r in dispatch.requests if r.deadline > now]
        skipped = frozenset(r.request_id for r in dispatch.requests if r.deadline <= now)
        rows = sum(r.rows for r in live)
        seconds = self._seconds(rows, max((self.item_cost[class_of(r)] for r in live), default=1.0))
        self.running = Running(dispatch, now, now + seconds, rows, skipped)
        self.batches += 1
        self.rows += rows
        self.busy_s += seconds
        return self.running

    def _seconds(self, rows: int, item_cost: float) -> float:
        if rows == 0:
            return 0.0
        seconds = (self.model.batch_seconds(rows, item_cost) + self.batch_overhead_s) / self.speed
        noise = self.noise
        if noise.sigma:
            seconds *= self.rng.lognormvariate(-noise.sigma * noise.sigma / 2, noise.sigma)
        if noise.stall_p and self.rng.random() < noise.stall_p:
            seconds += noise.stall_ms / 1000.0
        return seconds
