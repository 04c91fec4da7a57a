"""Simulated workers: one device each, like `worker/runner.py` — FIFO, merging, bounded, answering once.

Rules (the real runner's):
- batches run one forward at a time; when the device frees up, the forward is chosen by the real
  worker's merge (common/batching.py `next_forward`): the oldest waiting batch, joined by every later
  waiting batch of its lane (from any router) that fits the model's max batch size and max batch cost
  (first fit, arrival order) — each still gets its own answer;
- a batch arriving while the worker already holds `capacity` batches is answered at once with every item
  UNAVAILABLE `worker_busy` (the router places it elsewhere);
- when a forward starts, its items whose deadline has passed, or that their router told it to drop, are
  skipped (DEADLINE_EXCEEDED / CANCELLED, no device time); the rest execute together;
- a forward of r rows takes (a + c·k·r + overhead) / speed x noise (+ a stall now and then), where k is
  the largest per-item cost among its items (padding: a batch costs as its longest input);
- a crashed worker runs nothing more: its batches never come back, the routers must learn of the loss.
The worker draws its noise from its own generator, so adding a worker never changes another's times.
A lane stands for the real worker's merge key (model, version, padded shape; the simulator does not
model requested outputs).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Final

from sluice_inference.bench.sim.scenario import ModelSpec, Noise
from sluice_inference.common.batching import BatchLimits, Candidate, next_forward
from sluice_inference.common.errors import Code
from sluice_inference.router.policy.core import BUSY
from sluice_inference.router.policy.lanes import QueuedRequest
from sluice_inference.router.policy.outcomes import BatchAnswer, Dispatch, ItemAnswer

EXECUTED: Final = ItemAnswer()
"""The answer of every item that ran (a simulated worker returns no outputs): one, shared."""
SKIPPED: Final = {code: ItemAnswer(code) for code in (int(Code.CANCELLED), int(Code.DEADLINE_EXCEEDED))}
"""The answer of an item skipped when its forward started, by status code (shared likewise)."""
FULL: Final = ItemAnswer(int(Code.UNAVAILABLE), "worker full", reason=BUSY)
"""The answer of every item of a batch that found the worker full."""


def class_of(request: QueuedRequest) -> int:
    """The class of a simulated request (its payload is (arrival index, class index))."""
    assert isinstance(request.payload, tuple)
    cls: int = request.payload[1]
    return cls


@dataclass(frozen=True)
class Held:
    """A batch on the worker, the router it answers to, and the batch as the merge sees it."""

    dispatch: Dispatch
    router: int
    candidate: Candidate


@dataclass
class Running:
    """The forward on the device: the batches in it, their skipped items, when it ends."""

    batches: list[Held]
    started: float
    ends: float
    rows: int
    skipped: dict[int, int]
    """item id → status code of items that did not run."""

    def __init__(
        self, batches: list[Held], started: float, ends: float, rows: int, skipped: dict[int, int]
    ) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.batches = batches
        self.started = started
        self.ends = ends
        self.rows = rows
        self.skipped = skipped


@dataclass
class SimWorker:
    """One simulated device."""

    worker_id: str
    speed: float
    model: ModelSpec
    noise: Noise
    item_cost: list[float]
    """Per-item cost of each class (a request's payload names its class; the shell owns payloads)."""
    rng: random.Random
    capacity: int
    batch_overhead_s: float = 0.0
    """Per-batch time beyond the profile (calibrated)."""
    alive: bool = True
    draining: bool = False
    running: Running | None = None
    waiting: list[Held] = field(default_factory=list)
    """Accepted batches not yet run, oldest first."""
    dropped: set[int] = field(default_factory=set)
    forwards: int = 0
    rows: int = 0
    busy_s: float = 0.0
    forward_rows: list[int] = field(default_factory=list)
    max_held: int = 0
    """The most batches it ever held at once (all routers)."""
    limits: BatchLimits = field(init=False)
    """What one forward may hold: the model's limits, as the real worker takes them."""

    def __post_init__(self) -> None:
        self.limits = BatchLimits(self.model.max_batch_size, self.model.max_batch_cost)

    @property
    def held(self) -> int:
        """Batches it holds: waiting and running."""
        return len(self.waiting) + (len(self.running.batches) if self.running else 0)

    @property
    def idle(self) -> bool:
        """Nothing running or waiting."""
        return self.running is None and not self.waiting

    def accept(
        self, dispatch: Dispatch, router: int, now: float
    ) -> tuple[Running | None, BatchAnswer | None]:
        """A batch arrives: the forward that started now (if the device was idle), or the immediate
        `worker_busy` answer when the worker is full."""
        if not self.alive:
            return None, None  # lost: the routers learn it when they notice the crash
        if self.held >= self.capacity:
            busy = dict.fromkeys([r.request_id for r in dispatch.requests], FULL)
            return None, BatchAnswer(dispatch.batch_id, busy, 0, 0.0, self.held)
        cost = 0
        for request in dispatch.requests:  # a loop, not `sum` over a generator: one call per batch
            cost += request.cost
        candidate = Candidate(dispatch.lane, dispatch.rows, cost, self.limits)
        self.waiting.append(Held(dispatch, router, candidate))
        self.max_held = max(self.max_held, self.held)
        return (self._start_next(now) if self.running is None else None), None

    def drop(self, item_ids: list[int]) -> None:
        """A router no longer wants these items (skipped if they have not started)."""
        self.dropped.update(item_ids)

    def finish(self, now: float) -> tuple[Running, Running | None]:
        """The running forward ends at `now`; returns it and the forward that started next, if any."""
        done = self.running
        assert done is not None and math.isclose(done.ends, now)
        self.running = None
        return done, self._start_next(now)

    def answers(self, done: Running) -> list[tuple[int, BatchAnswer]]:
        """Each batch of a finished forward, answered to its router: (router, answer)."""
        execute_s, skipped = done.ends - done.started, done.skipped
        out = []
        for held in done.batches:
            items = dict.fromkeys([r.request_id for r in held.dispatch.requests], EXECUTED)
            for item_id, code in skipped.items():  # few or none: a loop over them, not a lookup per item
                if item_id in items:
                    items[item_id] = SKIPPED[code]
            answer = BatchAnswer(held.dispatch.batch_id, items, done.rows, execute_s, self.held)
            out.append((held.router, answer))
        return out

    def crash(self) -> None:
        """The device is gone with everything on it."""
        self.alive = False
        self.running = None
        self.waiting.clear()

    def _start_next(self, now: float) -> Running | None:
        if not self.waiting:
            return None
        chosen = set(next_forward([held.candidate for held in self.waiting]))
        batches = [held for i, held in enumerate(self.waiting) if i in chosen]
        self.waiting = [held for i, held in enumerate(self.waiting) if i not in chosen]
        skipped: dict[int, int] = {}
        dropped, item_cost = self.dropped, self.item_cost
        executed, cost = 0, None  # rows that run, and the largest per-item cost among them
        for held in batches:
            for request in held.dispatch.requests:
                if request.request_id in dropped:
                    dropped.discard(request.request_id)
                    skipped[request.request_id] = int(Code.CANCELLED)
                elif request.deadline <= now:
                    skipped[request.request_id] = int(Code.DEADLINE_EXCEEDED)
                else:
                    executed += request.rows
                    own = item_cost[class_of(request)]
                    if cost is None or own > cost:
                        cost = own
        seconds = self._seconds(executed, 1.0 if cost is None else cost)
        self.running = Running(batches, now, now + seconds, executed, skipped)
        self.forwards += 1
        self.rows += executed
        self.busy_s += seconds
        self.forward_rows.append(executed)
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
