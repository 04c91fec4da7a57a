"""When to cut a batch from a lane: a decision returns either a cut or the time to look again.

Two policies share one signature, `decide(lane, ctx) -> Cut | WakeAt`:

`TimerBatcher` — the classic one (Triton's dynamic batcher): cut when full, when the oldest request has
waited `max_wait`, or when the receiving worker is idle (work-conserving); never past a queued request's
budget.

`AdaptiveBatcher` — sets a target batch size per lane from the latency model t(n) = a + b·n, the lane's
arrival rate λ and this router's share W of the workers serving it (W = workers / routers: with N routers
behind a balancer, each sees about 1/N of the traffic and shares every worker with the others):
- **keep-up size**: the batch that fills while the previous one runs, n = μ·t(n) with μ = λ/W, i.e.
  n* = μ·a / (1 - μ·b) (the full batch when μ·b ≥ 1: the lane is overloaded). Smaller batches waste a
  on every few items and fall behind; larger ones only add waiting.
- **cut** when the lane holds n* rows; when the worker is idle and the lane cannot reach n* within
  `max_wait` (waiting buys nothing); or when waiting longer would break the tightest queued budget.
  Otherwise wait until n* is expected to be there, bounded by `max_wait` and the budget.
- **hold** while the receiving worker is busy: a batch cut now would only queue on the worker, so the
  router keeps collecting until just before the worker is expected to be free (`HOLD_LEAD_S`), unless the
  batch is full or a budget forces the cut. Found with the simulator: without the hold, moderate load cut
  small batches early and queued them on busy workers, and p99 was worse than the timer batcher's.
- **headroom mode**: when the lane's p99 uses < 40 % of its budget (latency is healthy) but the workers are
  under half busy at n*, grow the target to what arrives within half the tightest remaining budget: fewer,
  fuller batches cost less device time per item, capacity the autoscaler can reclaim. Hysteresis (enter
  below 40 %, leave above 60 % of the budget at p99) and the budget bound keep the loop stable: a larger
  target raises latency, which moves the lane out of the mode before any deadline is at risk.
- **the router's own CPU**: each batch also costs the router host CPU (`HostCost`: h per batch, c per row,
  measured by the shell) — cutting, framing and sending it, and taking its answer apart. While calls wait
  to reach the router's code (the front door's delay is above its bound: router/policy/door.py), the
  router's CPU is the constraint, and the target is at least the batch the router itself keeps up with:
  n_host = λ·h / (1 - Λ·c), Λ the router's arrival rate over all lanes (the full batch when Λ·c ≥ 1).
  Otherwise the host term is left out: batches fill because the CPU is short, never at low load.
- **CPU pressure**: how much of the time the router's event loop wants the CPU (running, or runnable and
  waiting for it: router/cpu_pressure.py). An idle worker is no reason to cut while the loop is busy most
  of the time: each batch costs the host its per-batch work (the router's cut, frame and answer, and on a
  shared host the worker's message handling and a small-batch forward), so a one-row batch cut because the
  worker is idle spends the CPU the next arrivals need. From `PRESSED` up, the lane holds its oldest
  request up to a share of `hold_factor` times the lane's `max_wait` that grows to all of it at
  `SATURATED` (unless the batch is full or a budget forces the cut); below `PRESSED` nothing changes, so
  latency at low load does not. Past `max_wait` (`hold_factor` > 1, `router.pressure_hold_factor`) only
  near saturation: the router's CPU is then the busy resource, as a busy worker is in the hold above, and
  its calls already wait for it before its code runs; a model's `max_wait` of 0 turns the hold off. The
  hold lowers the pressure it reacts to: the loop settles where the two meet. Measured on one core shared
  by router and worker (docs/performance.md): the rate held within the SLO and goodput under overload
  both rose with it, again when the hold could reach three times `max_wait`, and again at five.
Under overload n* is the full batch, which maximises throughput; when idle n* = 1, which minimises latency.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

from sluice_inference.router.policy.deadline_budget import DeadlineBudget
from sluice_inference.router.policy.lane_stats import LaneStats
from sluice_inference.router.policy.lanes import Lane

# Execution-time estimate for a batch of n rows of the lane being decided on.
BatchSeconds = Callable[[int], float]
HEADROOM_FRACTION: Final = 0.5
HOLD_LEAD_S: Final = 0.0005
"""A batch for a busy worker is cut this long before the worker is expected to be free, so it is there
(and staged) when the device becomes idle."""
PRESSED: Final = 0.5
"""CPU pressure (the event loop's share of the time it runs or waits to run) from which a lane holds its
batch for fuller ones instead of cutting for an idle worker."""
SATURATED: Final = 0.9
"""CPU pressure at which the hold is the lane's whole `max_wait` (a loop that wants the CPU this much of
the time is at its limit: the calls it has not reached yet are queueing)."""
UNDERUSED_BELOW: Final = 0.5


def _no_estimate(rows: int) -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class HostCost:
    """The router host's own CPU per batch and per row, and whether that CPU is the constraint now."""

    batch_s: float = 0.0
    """CPU seconds the router spends per batch, whatever its size (cut, frame, send, take apart)."""
    row_s: float = 0.0
    """CPU seconds the router spends per row (receive, decode, admit, answer)."""
    constrained: bool = False
    """Calls wait to reach the router's code (the door's delay is above its bound)."""
    rows_per_s: float = 0.0
    """Rows per second reaching the router, all lanes together."""
    pressure: float = 0.0
    """Share of the time the router's event loop runs or waits to run, 0..1 (the shell measures it)."""
    hold_factor: float = 1.0
    """How many times its `max_wait` a lane holds at `SATURATED` (`router.pressure_hold_factor`)."""

    def hold_s(self, max_wait_s: float) -> float:
        """How long a lane holds its oldest request for a fuller batch at this pressure: none below
        `PRESSED`, growing linearly to `hold_factor` times `max_wait_s` at `SATURATED`."""
        share = (self.pressure - PRESSED) / (SATURATED - PRESSED)
        return max_wait_s * self.hold_factor * min(1.0, share) if share > 0.0 else 0.0


NO_HOST_COST: Final = HostCost()


@dataclass(slots=True)
class BatchContext:
    """What a batching decision may look at besides the lane. (Not frozen, like the verdicts below: one
    is built per decision, and a frozen dataclass costs about five times as much to build; nothing
    changes one once built.)"""

    now: float
    worker_idle: bool
    batch_seconds: BatchSeconds = _no_estimate
    workers: float = 1.0
    """This router's share of the workers serving the lane (workers / live routers)."""
    stats: LaneStats = field(default_factory=LaneStats)
    worker_free_at: float = 0.0
    """When the receiving worker is expected to finish what it already holds (≤ now when idle)."""
    host: HostCost = NO_HOST_COST
    """The router's own CPU per batch and per row, and whether it is the constraint."""

    def __init__(  # noqa: PLR0917 (positional, as the dataclass's own `__init__` takes them)
        self,
        now: float,
        worker_idle: bool,
        batch_seconds: BatchSeconds = _no_estimate,
        workers: float = 1.0,
        stats: LaneStats | None = None,
        worker_free_at: float = 0.0,
        host: HostCost = NO_HOST_COST,
    ) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.now = now
        self.worker_idle = worker_idle
        self.batch_seconds = batch_seconds
        self.workers = workers
        self.stats = LaneStats() if stats is None else stats
        self.worker_free_at = worker_free_at
        self.host = host


@dataclass(slots=True)
class Cut:
    """Cut a batch from the lane now."""

    reason: str

    def __init__(self, reason: str) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.reason = reason


@dataclass(slots=True)
class WakeAt:
    """Nothing to do before `when` unless an event arrives — and an arrival changes nothing either until
    the lane holds `rows` rows (so the core need not ask again on every arrival)."""

    when: float
    rows: int

    def __init__(self, when: float, rows: int) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.when = when
        self.rows = rows


class Batcher(Protocol):
    """A batching policy."""

    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        """Decide for a non-empty lane that has a worker with a free slot."""
        ...


def _budget_bound(lane: Lane, ctx: BatchContext) -> float | None:
    """The last moment to cut so the most urgent queued request still makes its deadline (the deadline
    budget's `cut_by`)."""
    latest = lane.earliest_latest_start()
    if latest is None:
        return None
    return DeadlineBudget.cut_by(latest, ctx.batch_seconds(lane.limits.max_batch_size), ctx.batch_seconds(1))


def _head(lane: Lane) -> float:
    oldest = lane.oldest_arrival()
    if oldest is None:
        raise ValueError(f"lane {lane.key} is empty")
    return oldest


class TimerBatcher:
    """Cut on full, on max wait, on the tightest budget, or when the receiving worker is idle."""

    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        """See the module docstring."""
        oldest = _head(lane)
        if lane.rows >= lane.limits.max_batch_size:
            return Cut("full")
        if ctx.now >= oldest + lane.limits.max_wait_s:
            return Cut("max_wait")
        cut_by = oldest + lane.limits.max_wait_s
        bound = _budget_bound(lane, ctx)
        if bound is not None:
            if ctx.now >= bound:
                return Cut("deadline")
            cut_by = min(cut_by, bound)
        if ctx.worker_idle:
            return Cut("idle_worker")
        return WakeAt(cut_by, lane.limits.max_batch_size)


def latency_line(batch_seconds: BatchSeconds, max_batch: int) -> tuple[float, float]:
    """(a, b) of t(n) = a + b·n, read off the estimate at 1 and at the full batch."""
    t1 = batch_seconds(1)
    b = (batch_seconds(max_batch) - t1) / (max_batch - 1) if max_batch > 1 else 0.0
    return max(0.0, t1 - b), b


def keep_up_size(rows_per_s: float, workers: float, batch_seconds: BatchSeconds, max_batch: int) -> int:
    """The batch that fills while the previous one runs on each of `workers`: n* = μa / (1 - μb)."""
    a, b = latency_line(batch_seconds, max_batch)
    per_worker = rows_per_s / max(1e-9, workers)
    if per_worker * b >= 1.0:
        return max_batch
    return max(1, min(max_batch, math.ceil(per_worker * a / (1.0 - per_worker * b))))


def host_keep_up_size(rows_per_s: float, host: HostCost, max_batch: int) -> int:
    """The batch the router's own CPU keeps up with while it is the constraint: n = λh / (1 - Λc) (λ the
    lane's rows per second, Λ the router's); 1 while it is not."""
    if not host.constrained or host.batch_s <= 0.0:
        return 1
    spare = 1.0 - host.rows_per_s * host.row_s
    if spare <= 0.0:
        return max_batch
    return max(1, min(max_batch, math.ceil(rows_per_s * host.batch_s / spare)))


class AdaptiveBatcher:
    """Target batch size from the latency model and the arrival rate (see the module docstring)."""

    def target(self, lane: Lane, ctx: BatchContext) -> int:
        """The batch size to aim for now."""
        limit = lane.limits.max_batch_size
        rate = ctx.stats.rate(ctx.now)
        keep_up = keep_up_size(rate, ctx.workers, ctx.batch_seconds, limit)
        if ctx.host.constrained:
            keep_up = max(keep_up, host_keep_up_size(rate, ctx.host, limit))
        if keep_up >= limit:
            return limit
        a, b = latency_line(ctx.batch_seconds, limit)
        busy = rate / max(1e-9, ctx.workers) * (a / keep_up + b)
        bound = _budget_bound(lane, ctx)
        if ctx.stats.healthy and busy < UNDERUSED_BELOW and bound is not None and rate > 0:
            allowance = min(lane.limits.max_wait_s, HEADROOM_FRACTION * max(0.0, bound - ctx.now))
            return max(keep_up, min(limit, math.floor(lane.rows + rate * allowance)))
        return keep_up

    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        """See the module docstring."""
        oldest = _head(lane)
        limits = lane.limits
        if lane.rows >= limits.max_batch_size:
            return Cut("full")
        bound = _budget_bound(lane, ctx)
        if bound is not None and ctx.now >= bound:
            return Cut("deadline")
        hold_until = ctx.worker_free_at - HOLD_LEAD_S
        if not ctx.worker_idle and ctx.now < hold_until:
            # The worker is busy: a batch sent now would only wait there. Keep collecting (a fuller batch,
            # and the choice of worker stays open) until just before it is free, or the budget says go.
            return WakeAt(hold_until if bound is None else min(hold_until, bound), limits.max_batch_size)
        held_until = oldest + ctx.host.hold_s(limits.max_wait_s)
        if ctx.now < held_until:
            # The router's loop is short of CPU: hold for a fuller batch (module docstring).
            return WakeAt(held_until if bound is None else min(held_until, bound), limits.max_batch_size)
        target = self.target(lane, ctx)
        if lane.rows >= target:
            return Cut("target")
        give_up = oldest + limits.max_wait_s
        if ctx.now >= give_up:
            return Cut("max_wait")
        rate = ctx.stats.rate(ctx.now)
        filled_at = ctx.now + (target - lane.rows) / rate if rate > 0 else math.inf
        cut_by = min(give_up, filled_at, bound if bound is not None else math.inf)
        if ctx.worker_idle and filled_at > min(give_up, bound if bound is not None else math.inf):
            return Cut("idle_worker")
        return WakeAt(cut_by, target)
