"""The batch planner: for a lane, whether to send a batch now and to which worker, or how long to wait.

It owns the batching policy (batcher.py), the worker chooser (scheduler.py), the router's own host cost and
each lane's last decision to wait, and returns one `Step` per question; the core carries the step out
(pops the batch, records it in flight) and asks again while the lane holds requests.

Invariants: a remembered wait is dropped when its lane's shape is forgotten (`forget`) or the host cost
changes (`set_host`); it is reused only while the worker pool's epoch is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Final

from sluice_inference.router.policy.batcher import NO_HOST_COST, BatchContext, Batcher, Cut, HostCost
from sluice_inference.router.policy.estimators import ServiceEstimates
from sluice_inference.router.policy.lane_stats import LaneStats
from sluice_inference.router.policy.lanes import Lane, LaneKey, QueuedRequest
from sluice_inference.router.policy.scheduler import Chooser, Job
from sluice_inference.router.policy.workers import WorkerPool, WorkerSlot


@dataclass(slots=True)
class _Waiting:
    """A lane's last decision to wait: until `when`, or until it holds `rows`, taken at `epoch` of the
    worker pool, when its tightest latest start was `latest_start`. (This and the steps below are not
    frozen: one is built per decision, and a frozen dataclass costs about five times as much to build;
    nothing changes one once built.)"""

    when: float
    rows: int
    epoch: int
    latest_start: float


@dataclass(slots=True)
class Send:
    """Cut a batch off the lane now, for `worker`, because of `reason`."""

    worker: WorkerSlot
    reason: str


@dataclass(slots=True)
class Wait:
    """Leave the lane until `when` (or an event)."""

    when: float


MAX_HOST_S: Final = 1.0
"""Most CPU seconds per batch or per row a shell may report: anything above is a measuring error."""
NO_WORKER: Final = "no_worker"
"""No accepting worker serves the lane's version: its requests end."""
BLOCKED: Final = "blocked"
"""Every serving worker is full or breaker-blocked: an answer or a reopen will tick the core."""
Step = Send | Wait | str


class Planner:
    """Batching and worker choice for the lanes of one router."""

    def __init__(self, batcher: Batcher, chooser: Chooser) -> None:
        self.batcher = batcher
        self.chooser = chooser
        self.host = NO_HOST_COST
        """The router's own CPU per batch and per row, and whether it is the constraint (`host_load`)."""
        self._waiting: dict[LaneKey, _Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def forget(self, key: LaneKey) -> None:
        """The lane's shape was forgotten."""
        self._waiting.pop(key, None)

    def set_host(self, host: HostCost) -> None:
        """A new host cost: every remembered wait was decided at the old one. Raises ValueError for a cost
        outside 0..`MAX_HOST_S`."""
        for name, value in (("batch_s", host.batch_s), ("row_s", host.row_s)):
            if not 0.0 <= value <= MAX_HOST_S:  # NaN fails too
                raise ValueError(f"host_load: {name} must lie in 0..{MAX_HOST_S} s, not {value!r}")
        if not 0.0 <= host.pressure <= 1.0:
            raise ValueError(f"host_load: pressure must lie in 0..1, not {host.pressure!r}")
        self.host = host
        self._waiting.clear()

    def still_waiting(self, lane: Lane, newcomer: QueuedRequest, now: float, epoch: int) -> float | None:
        """When the lane's last decision to wait ends, if it still stands after `newcomer` joined: nothing
        about the workers changed since (`epoch`), the lane is still short of the rows it waited for, its
        time has not come, and the newcomer's budget is no tighter (asking again would say the same; on a
        busy lane this spares a decision per arrival). None: decide afresh."""
        waiting = self._waiting.get(lane.key)
        if (
            waiting is not None
            and waiting.epoch == epoch
            and now < waiting.when
            and lane.rows < waiting.rows
            and newcomer.latest_start >= waiting.latest_start
        ):
            return waiting.when
        return None

    def step(
        self,
        lane: Lane,
        now: float,
        *,
        workers: WorkerPool,
        estimates: ServiceEstimates,
        stats: LaneStats,
        routers: int,
        arrival_rate: float,
    ) -> Step:
        """What to do with the (non-empty) lane now; `arrival_rate` is the router's rows per second, which
        only a constrained host reads."""
        key = lane.key
        version = (key.model, key.version)
        serving = workers.serving_count(version)
        if not serving:
            return NO_WORKER
        free = workers.free(version)

        batch_rows = min(lane.rows, lane.limits.max_batch_size)  # the batch that would be cut now

        def seconds_on(worker_id: str) -> float:
            return estimates.batch_seconds(key.model, key.version, batch_rows, worker_id, key.shape)

        worker = self.chooser.choose(free, Job(batch_rows, now, seconds_on))
        if worker is None:
            return BLOCKED
        known: dict[int, float] = {}

        def batch_seconds(rows: int) -> float:  # asked several times per decision: once per size
            seconds = known.get(rows)
            if seconds is None:
                seconds = known[rows] = estimates.batch_seconds(key.model, key.version, rows, shape=key.shape)
            return seconds

        idle = worker.in_flight_batches == 0 and worker.others == 0
        free_at = max(worker.busy_until, worker.others_free_at)
        host = self.host
        if host.constrained:
            host = replace(host, rows_per_s=arrival_rate)
        context = BatchContext(now, idle, batch_seconds, serving / routers, stats, free_at, host)
        verdict = self.batcher.decide(lane, context)
        if isinstance(verdict, Cut):
            return Send(worker, verdict.reason)
        latest = lane.earliest_latest_start()
        self._waiting[key] = _Waiting(
            verdict.when, verdict.rows, workers.epoch, math.inf if latest is None else latest
        )
        return Wait(verdict.when)
