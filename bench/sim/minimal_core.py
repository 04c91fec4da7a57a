"""The floor under the policy core's speed: a simulator scenario served by the least policy that still keeps
the promises, measured beside `sluice sim` on the very same arrivals.

The per-core issue asks the policy core for ≤ 10 µs of CPU per request, shown by `sluice sim` at ≥ 100,000
simulated requests per wall-clock second at 1,000 workers. Whether Python allows that is a question for a
minimal path, not an estimate: this module runs the scenario's arrivals (the same `RunPlan`) through a core
and an event loop that do only what every request needs, and nothing Sluice adds on top:
- admission: the tenant's token bucket (refilled per arrival) and in-flight count, and the deadline
  feasibility check (its budget against a full batch's time), refused explicitly;
- queueing: one FIFO per lane and priority, the best priority served first (no aging, no fair shares, no
  queue bounds, no shapes to bound);
- batching: cut when the lane holds the keep-up batch for the scenario's known rate (an oracle target, as the
  minimal path's door is an oracle) or its oldest request has waited `max_wait`, one timer per lane;
- dispatch: any free worker (a stack of them), a request already past its deadline ended instead of sent;
  an answer ready after its deadline ends DEADLINE_EXCEEDED, never OK;
- the worker: one forward per batch, timed as the simulator's workers time it (a + c·rows over its speed,
  lognormal noise, rare stalls), one event per batch;
- the end: every request ends once, OK or with its status, and its latency is recorded.
No estimates are learned, no statistics kept, no breaker, health, ledger or decision objects: what is left
is the work a batching router cannot skip, done plainly. If even this missed the goal on a scenario, the
goal would be out of reach in this Python; where it meets it, the gap to `sluice sim`'s rate (printed
beside it, measured on the same arrivals in the same process) is what Sluice's own policy and its event
loop cost.

Run: python -m sluice_inference.bench.sim.minimal_core bench/scenarios/sim_scale.yaml [--duration 0.2]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from sluice_inference.bench.sim.engine import simulate
from sluice_inference.bench.sim.plan import RunPlan, plan_run
from sluice_inference.bench.sim.scenario import SimScenario, load_sim_scenario
from sluice_inference.router.policy.batcher import keep_up_size
from sluice_inference.router.policy.lanes import LaneKey

OK, REFUSED, EXPIRED = 0, 1, 2
"""How a request ended: served, refused at admission (its budget cannot cover a batch), past its deadline
(before its batch left, or when its answer came)."""
TOKENS_PER_S = 1e12
"""The tenants' rate: unlimited, as the simulator's tenants are without quotas (the bucket still runs)."""


@dataclass(frozen=True)
class MinimalResult:
    """One run of the minimal core."""

    requests: int
    ended: list[int]
    """How each request ended (`OK`, `REFUSED`, `EXPIRED`), by arrival index."""
    latencies_s: list[float]
    """Each request's time from arrival to its answer (or refusal), by arrival index."""
    batches: int
    wall_s: float
    """The event loop's wall time, start-up excluded."""

    @property
    def rate(self) -> float:
        """Simulated requests per wall-clock second."""
        return self.requests / self.wall_s

    @property
    def mean_batch(self) -> float:
        """Rows per batch."""
        return self.ended.count(OK) / max(1, self.batches)

    def p99_ms(self) -> float:
        """The 99th percentile latency of served requests."""
        served = sorted(s for s, e in zip(self.latencies_s, self.ended, strict=True) if e == OK)
        return 1000 * served[min(len(served) - 1, math.ceil(0.99 * len(served)) - 1)] if served else 0.0


def keep_up_rows(scenario: SimScenario, rate: float) -> int:
    """The batch that fills while the previous one runs on every worker at the scenario's rate: the
    adaptive batcher's own keep-up size (router/policy/batcher.py), workers counted by their speed."""
    model = scenario.model
    workers = sum(group.count * group.speed for group in scenario.workers)
    return keep_up_size(rate, workers, model.batch_seconds, model.max_batch_size)


class MinimalCore:
    """The minimal core and its event loop over one plan (module docstring). Use once: `.run()`."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        scenario = plan.scenario
        model, self.noise = scenario.model, scenario.noise
        self.a, self.b = model.base_ms / 1000, model.per_item_ms / 1000
        self.full, self.max_wait = model.max_batch_size, model.max_wait_ms / 1000
        self.target = keep_up_rows(scenario, plan.rate)
        self.full_s = self.a + self.b * self.full
        specs = scenario.classes
        self.deadline_of = [c.deadline_ms / 1000 for c in specs]
        self.tenant_of = [c.tenant for c in specs]
        self.lane_of = [plan.lanes[c] for c in range(len(specs))]
        self.priority_of = [c.priority for c in specs]
        priorities = sorted(set(self.priority_of))
        self.lanes: dict[LaneKey, dict[int, deque[int]]] = {
            key: {p: deque() for p in priorities} for key in set(self.lane_of)
        }
        """Each lane's FIFO per priority, the best priority first: arrival indexes."""
        self.waiting = dict.fromkeys(self.lanes, 0)
        self.timer_at = dict.fromkeys(self.lanes, math.inf)
        self.buckets = {tenant: [TOKENS_PER_S, 0.0] for tenant in set(self.tenant_of)}
        """Each tenant's token bucket: [tokens, when last refilled]."""
        self.inflight = dict.fromkeys(self.buckets, 0)
        self.speeds = [group.speed for group in scenario.workers for _ in range(group.count)]
        self.free = list(range(len(self.speeds)))
        self.rng = random.Random(scenario.seed)
        n = plan.arrivals
        self.ended, self.latencies = [-1] * n, [0.0] * n
        self.events: list[tuple[float, int, int, list[int] | LaneKey]] = []
        """(when, sequence, worker, its batch) for an answer; (when, sequence, -1, lane) for a timer."""
        self.seq = 0
        self.batches = 0

    def run(self) -> MinimalResult:
        """Every arrival to its end."""
        plan, events = self.plan, self.events
        times, classes, n = plan.times_s, plan.classes, plan.arrivals
        started = time.perf_counter()
        i = 0
        while i < n or events:
            if i < n and (not events or times[i] <= events[0][0]):
                self.arrive(i, classes[i], times[i])
                i += 1
                continue
            now, _, worker, data = heapq.heappop(events)
            if isinstance(data, list):
                self.answered(worker, data, now)
            else:
                self.timer_at[data] = math.inf
                self.cut(data, now)
        wall_s = time.perf_counter() - started
        return MinimalResult(n, self.ended, self.latencies, self.batches, wall_s)

    def arrive(self, index: int, cls: int, now: float) -> None:
        """Admit (the tenant's bucket and in-flight count, the deadline against a full batch) and queue,
        or refuse; then cut if the lane is ready."""
        tenant = self.tenant_of[cls]
        bucket = self.buckets[tenant]
        bucket[0] = min(TOKENS_PER_S, bucket[0] + (now - bucket[1]) * TOKENS_PER_S)
        bucket[1] = now
        self.inflight[tenant] += 1
        if bucket[0] < 1 or self.deadline_of[cls] < self.full_s:
            self.end(index, REFUSED, now)
            return
        bucket[0] -= 1
        key = self.lane_of[cls]
        self.lanes[key][self.priority_of[cls]].append(index)
        self.waiting[key] += 1
        self.cut(key, now)

    def answered(self, worker: int, batch: list[int], now: float) -> None:
        """A forward ended: its requests end, never OK after their deadline (router/policy/deadline_budget.py
        `finished_late`), and the worker takes the next batch."""
        deadline_of, classes, times = self.deadline_of, self.plan.classes, self.plan.times_s
        for index in batch:
            self.end(index, OK if now <= times[index] + deadline_of[classes[index]] else EXPIRED, now)
        self.free.append(worker)
        for key in self.lanes:
            self.cut(key, now)

    def cut(self, key: LaneKey, now: float) -> None:
        """Send the lane's batches while a worker is free and the lane holds the target or its oldest
        request has waited `max_wait`; else make sure its timer is set."""
        levels, free = self.lanes[key], self.free
        while (
            free
            and self.waiting[key]
            and (self.waiting[key] >= self.target or self.oldest(levels) + self.max_wait <= now)
        ):
            batch = self.take(key, levels, now)
            if batch:
                self.start(free.pop(), batch, now)
        if self.waiting[key] and free and self.timer_at[key] == math.inf:  # no free worker: answers cut
            self.timer_at[key] = when = self.oldest(levels) + self.max_wait
            self.seq += 1
            heapq.heappush(self.events, (when, self.seq, -1, key))

    def take(self, key: LaneKey, levels: dict[int, deque[int]], now: float) -> list[int]:
        """Up to a full batch from the lane, the best priority first; a request already past its deadline
        ends instead."""
        batch: list[int] = []
        deadline_of, classes, times = self.deadline_of, self.plan.classes, self.plan.times_s
        for queue in levels.values():
            while queue and len(batch) < self.full:
                index = queue.popleft()
                self.waiting[key] -= 1
                if times[index] + deadline_of[classes[index]] <= now:
                    self.end(index, EXPIRED, now)
                else:
                    batch.append(index)
        return batch

    def start(self, worker: int, batch: list[int], now: float) -> None:
        """The worker runs the batch as the simulator's workers time a forward (bench/sim/workers.py)."""
        noise = self.noise
        seconds = (self.a + self.b * len(batch)) / self.speeds[worker]
        if noise.sigma:
            seconds *= self.rng.lognormvariate(-noise.sigma * noise.sigma / 2, noise.sigma)
        if noise.stall_p and self.rng.random() < noise.stall_p:
            seconds += noise.stall_ms / 1000
        self.seq += 1
        self.batches += 1
        heapq.heappush(self.events, (now + seconds, self.seq, worker, batch))

    def oldest(self, levels: dict[int, deque[int]]) -> float:
        """The arrival of the lane's oldest request."""
        times = self.plan.times_s
        return min(times[queue[0]] for queue in levels.values() if queue)

    def end(self, index: int, how: int, now: float) -> None:
        """The request ends, once: its outcome and latency are recorded and its in-flight slot freed."""
        self.ended[index] = how
        self.latencies[index] = now - self.plan.times_s[index]
        self.inflight[self.tenant_of[self.plan.classes[index]]] -= 1


def run_minimal(plan: RunPlan) -> MinimalResult:
    """Every arrival of `plan` through the minimal core (module docstring)."""
    return MinimalCore(plan).run()


def main(argv: list[str] | None = None) -> int:
    """Run the scenario through the minimal core and through `sluice sim`'s, and print both rates."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", type=Path)
    parser.add_argument("--duration", type=float, help="seconds of arrivals (overrides duration_s)")
    args = parser.parse_args(argv)
    overrides = {} if args.duration is None else {"duration_s": args.duration}
    plan = plan_run(load_sim_scenario(args.scenario, overrides))
    minimal = run_minimal(plan)
    sluice = simulate(plan)
    sluice_rate, sluice_rows = plan.arrivals / sluice.wall_s, statistics.fmean(sluice.batch_rows)
    print(f"{args.scenario.name}: {plan.arrivals:,} arrivals at {plan.rate:,.0f} req/s, "
          f"{sum(g.count for g in plan.scenario.workers):,} workers")  # fmt: skip
    print(f"  minimal core: {minimal.rate:,.0f} requests per wall-clock second "
          f"({1e6 / minimal.rate:.1f} µs each); {minimal.mean_batch:.1f} rows a batch, "
          f"p99 {minimal.p99_ms():.1f} ms, {minimal.ended.count(OK) / minimal.requests:.1%} OK")  # fmt: skip
    print(f"  sluice sim:   {sluice_rate:,.0f} requests per wall-clock second "
          f"({1e6 / sluice_rate:.1f} µs each); {sluice_rows:.1f} rows a batch")  # fmt: skip
    print(f"  ratio: Sluice's core runs at {sluice_rate / minimal.rate:.2f}x the minimal core's rate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
