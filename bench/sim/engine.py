"""The event loop: the second driver of the router core, under virtual time (docs/design.md §10).

Like `router/driver.py` it only translates events into `RouterCore` calls and carries the returned
decisions out — the rules are the core's, so the simulator cannot drift from the server:
- an arrival → `arrive` on one of the routers (in turn, or as its class's `placement` says); a simulated
  worker's answer → `answered` on the router that sent the batch; a crash noticed → `worker_left` on every
  router; a drain → the worker registered as draining, then `worker_left` once it is idle; every
  `load_report_ms` → `worker_reported` (what each worker holds, from every router) on every router; a
  router's timer → `tick`;
- a decision's dispatches go to the simulated workers (which merge, skip and refuse as the real runner
  does: bench/sim/workers.py), its settled requests become records, its drops reach the workers, and each
  router's one timer is re-armed at `wake_at` (a superseded timer never fires, as the driver's alarm);
- with quotas and several routers, each router has a publish round every interval its core asks for
  (`publish_demand`, staggered across routers as unsynchronised processes are); what it publishes reaches
  every other router `demand_delay_ms` later (`set_peers`, as router/peers.py does on a watch event), and
  the publisher counts it in full `OWN_GRACE_S` later (`count_published`).
Time only moves by jumping to the next event, so a run is deterministic for a seed and as fast as the
core allows.

Invariant: every arrival ends exactly once — OK, or a SluiceError's status and reason. `run` raises if
any request ended twice or never ended.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Final, NamedTuple

from sluice_inference.bench.loadgen_stats import RequestRecord
from sluice_inference.bench.sim.plan import RunPlan
from sluice_inference.bench.sim.results import SimResult, WorkerStats
from sluice_inference.bench.sim.scenario import Failure, SimScenario, worker_ids
from sluice_inference.bench.sim.workers import Running, SimWorker
from sluice_inference.common.buckets import row_cost
from sluice_inference.common.errors import SluiceError
from sluice_inference.common.heap import young_collections_every
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings, TenantSettings
from sluice_inference.router.policy.core import DecisionObserver, RouterCore
from sluice_inference.router.policy.demand import NO_DEMAND, Demand
from sluice_inference.router.policy.lanes import LaneKey, LaneLimits, QueuedRequest
from sluice_inference.router.policy.outcomes import BatchAnswer, Decision, Served
from sluice_inference.router.policy.shares import OWN_GRACE_S

# The kinds of event on the simulator's heap (Final: the compiled engine compares them as constants).
ARRIVAL: Final = 0
DONE: Final = 1
ANSWER: Final = 2
TIMER: Final = 3
CRASH: Final = 4
NOTICED: Final = 5
DRAIN: Final = 6
REPORT: Final = 7
PUBLISH: Final = 8
PEER: Final = 9
COUNTED: Final = 10
UNLIMITED: Final = TenantSettings(
    rate=1e12, burst=10**12, max_inflight=10**12, default_priority=9, max_priority=1
)
SETTLE_S: Final = 60.0
"""After the last arrival plus the longest deadline, a run that still has events is broken: stop."""
MAX_SPINS: Final = 1000
TIMER_SLACK_S: Final = 1e-6
"""A timer fires this long after `wake_at`, as a real one never fires early. (The core compares `now` with
the very instants it asks to be woken at, so it needs no slack to make progress; `run` stops a core that
asks for the same instant over and over.)"""
BYTES_PER_ROW_ITEM: Final = 4
"""FP32: a request's queued bytes are rows x length x 4 (admission's byte bound)."""
RUN_YOUNG_THRESHOLD: Final = 100_000
"""Allocations between young collections during a run. At CPython's 700 the collector took 8-10 % of a run
on `sim_scale.yaml` and found nothing: every object a run makes is freed by its last reference."""
CoreFactory = Callable[[int, RunPlan], RouterCore]
SIM_DEVICE: Final = "accelerator"
"""What a simulated worker registers as: its batch time does not share the router's CPU, as an accelerator's
does not, so a router keeps two batches on it (`router.batches_in_flight_per_worker` by device)."""


class _ClassConstants(NamedTuple):
    """What every arrival of one traffic class carries (`Simulation._class_constants`)."""

    deadline_s: float
    input_bytes: int
    cost: int
    lane: LaneKey
    limits: LaneLimits
    rows: int
    tenant: str
    priority: int
    placement: list[int] | None


def make_core(router: int, plan: RunPlan, *, observer: DecisionObserver | None = None) -> RouterCore:
    """The core one simulated router runs: the plan's policy; tenants unlimited unless the scenario gives
    them a quota (`observer`: told every decision, for a test's log)."""
    policy = plan.policy
    settings = RouterSettings(batcher=policy.batcher, scheduler=policy.scheduler)
    admission = AdmissionSettings(
        enabled=policy.admission, lane_max_queued=policy.lane_max_queued, quota_shares=policy.quota_shares
    )
    tenants = {c.tenant: _tenant(plan.scenario, c.tenant) for c in plan.scenario.classes}
    rng = random.Random(plan.scenario.seed * 7919 + router)
    return RouterCore(
        0.0, settings=settings, admission=admission, tenants=tenants, rng=rng, observer=observer
    )


def _tenant(scenario: SimScenario, name: str) -> TenantSettings:
    quota = scenario.quotas.get(name)
    if quota is None:
        return UNLIMITED
    return UNLIMITED.model_copy(
        update={"rate": quota.rate, "burst": quota.burst, "max_inflight": quota.max_inflight}
    )


class Simulation:
    """One run of a plan. Use once: `Simulation(plan).run()`."""

    def __init__(self, plan: RunPlan, core_factory: CoreFactory = make_core) -> None:
        self.plan = plan
        scenario = plan.scenario
        self.overhead_s = scenario.overhead_ms / 1000.0
        self.classes = scenario.classes
        self.cores = [core_factory(r, plan) for r in range(scenario.routers)]
        self._warmup = self._warmup_timings()
        self._per_class = [self._class_constants(c) for c in range(len(self.classes))]
        costs = [c.item_cost for c in scenario.classes]
        self.workers: dict[str, SimWorker] = {}
        ids = iter(worker_ids(scenario.workers))
        for index, group in enumerate(scenario.workers):
            for k in range(group.count):
                worker_id = next(ids)
                rng = random.Random(scenario.seed * 1_000_003 + index * 100_003 + k)
                self.workers[worker_id] = SimWorker(
                    worker_id, group.speed, scenario.model, scenario.noise, costs, rng, group.capacity,
                    scenario.batch_overhead_ms / 1000,
                )  # fmt: skip
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._timer_at: list[float | None] = [None] * len(self.cores)
        self._timer_gen = [0] * len(self.cores)
        self._last_fired = [-1.0] * len(self.cores)
        self._spins = [0] * len(self.cores)
        self._records: list[RequestRecord | None] = [None] * plan.arrivals
        self._placed = [0] * len(self.classes)
        """Requests of each class placed so far (a class with a `placement` takes its routers in turn)."""
        self._published: dict[str, Demand] = {f"r{r}": NO_DEMAND for r in range(len(self.cores))}
        """What each router last published, as the others read it."""
        self.batch_rows: list[int] = []
        self.cut_reasons: Counter[str] = Counter()
        self.late_rows = 0
        self.redispatched = 0
        self.events = 0
        for failure in scenario.failures:
            self._push(failure.at_s, CRASH if failure.kind == "crash" else DRAIN, failure)
        for router, core in enumerate(self.cores):
            core.set_peers(0.0, self._peers_of(router))
            for worker in self.workers.values():
                self._register(router, worker, ready=True, now=0.0)
                self._apply(router, core.worker_connected(0.0, worker.worker_id, True), 0.0)
        if len(self.cores) > 1 and scenario.workers_report_load:
            self._push(scenario.load_report_ms / 1000.0, REPORT, None)
        if len(self.cores) > 1 and scenario.quotas:
            for router, core in enumerate(self.cores):
                interval = core.publish_interval_s()
                self._push(interval * (1 + router / len(self.cores)), PUBLISH, router)

    def _class_constants(self, cls: int) -> _ClassConstants:
        """What every arrival of a class carries, worked out once: its deadline in seconds, its queued
        bytes and its cost (rows x the lane's padded length, its shape bucket: common/buckets.py `row_cost`
        of its one variable-length input, as the router's codec counts it), with the rest of its spec."""
        spec = self.classes[cls]
        lane = self.plan.lanes[cls]
        length = lane.shape[0][1][0]
        cost = spec.rows * row_cost(((-1,) * len(dims), dims) for _, dims in lane.shape)
        return _ClassConstants(
            spec.deadline_ms / 1000.0, spec.rows * length * BYTES_PER_ROW_ITEM, cost, lane,
            self.plan.limits[cls], spec.rows, spec.tenant, spec.priority, spec.placement,
        )  # fmt: skip

    def _warmup_timings(self) -> dict[int, float]:
        """What the workers' warm-up would measure: a speed-1 device, batch sizes 1 and max, on the smallest
        shape bucket (as `worker/main.py` times them)."""
        model = self.plan.scenario.model
        smallest = min(self.classes, key=lambda c: c.length)
        return {rows: model.batch_seconds(rows, smallest.item_cost) for rows in (1, model.max_batch_size)}

    def _register(self, router: int, worker: SimWorker, *, ready: bool, now: float) -> None:
        model = self.plan.scenario.model
        models = {(model.name, model.version): self._warmup}
        decision = self.cores[router].worker_registered(
            now, worker.worker_id, models, worker.capacity, ready, device=SIM_DEVICE
        )
        self._apply(router, decision, now)

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Run every arrival to its end; returns the outcomes. A run leaves no cyclic garbage (the core
        keeps no refusal's traceback: router/policy/endings.py `refused`), so young collections are
        spaced out while it runs (`RUN_YOUNG_THRESHOLD`)."""
        with young_collections_every(RUN_YOUNG_THRESHOLD):
            return self._run()

    def _run(self) -> SimResult:
        started, cpu_started = time.perf_counter(), time.process_time()
        times, classes = self.plan.times_s, self.plan.classes
        longest = max(c.deadline_ms for c in self.classes) / 1000.0
        stop_at = self.plan.scenario.duration_s + longest + SETTLE_S
        i, n = 0, len(times)
        now = 0.0
        queue, arrive, handle, heappop = self._events, self.arrive, self._handle, heapq.heappop
        while i < n or queue:
            if i < n and (not queue or times[i] <= queue[0][0]):
                now = times[i]
                arrive(i, classes[i], now)
                i += 1
            else:
                now, _, kind, data = heappop(queue)
                if now > stop_at:
                    break
                handle(kind, data, now, arrivals_left=i < n)
            self.events += 1
        return self._result(now, time.perf_counter() - started, time.process_time() - cpu_started)

    def _push(self, when: float, kind: int, data: object) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, data))

    def _handle(self, kind: int, data: object, now: float, *, arrivals_left: bool) -> None:
        if kind == TIMER:
            assert isinstance(data, tuple)
            router, generation = data
            if generation == self._timer_gen[router]:
                self._fired(router, now)
                self.tick(router, now)
        elif kind == DONE:
            assert isinstance(data, SimWorker)
            self._forward_done(data, now)
        elif kind == ANSWER:
            assert isinstance(data, tuple)
            router, worker_id, answer = data
            self.answered(router, worker_id, answer, now)
        elif kind == CRASH:
            assert isinstance(data, Failure)
            self.workers[data.worker].crash()
            self._push(now + data.detect_ms / 1000.0, NOTICED, data.worker)
        elif kind == NOTICED:
            assert isinstance(data, str)
            self.worker_left(data, "crashed", now)
        elif kind == DRAIN:
            assert isinstance(data, Failure)
            worker = self.workers[data.worker]
            worker.draining = True
            for router in range(len(self.cores)):
                self._register(router, worker, ready=False, now=now)
            self._leave_if_drained(worker, now)
        elif kind == REPORT:
            self._report(now)
            if arrivals_left or self._events:
                self._push(now + self.plan.scenario.load_report_ms / 1000.0, REPORT, None)
        elif kind in (PUBLISH, PEER, COUNTED):
            self._share_event(kind, data, now, arrivals_left=arrivals_left)

    def _share_event(self, kind: int, data: object, now: float, *, arrivals_left: bool) -> None:
        if kind == PUBLISH:
            assert isinstance(data, int)
            self.publish(data, now)
            if arrivals_left:
                self._push(now + self.cores[data].publish_interval_s(), PUBLISH, data)
        elif kind == PEER:
            assert isinstance(data, tuple)
            router, demand = data
            self.peer_published(router, demand, now)
        else:
            assert isinstance(data, int)
            self.cores[data].count_published(now)

    def _fired(self, router: int, now: float) -> None:
        """A router's timer fired; a core that asks to be woken at the same instant forever is a bug."""
        self._timer_at[router] = None
        self._spins[router] = self._spins[router] + 1 if now == self._last_fired[router] else 0
        self._last_fired[router] = now
        if self._spins[router] > MAX_SPINS:
            raise AssertionError(f"router {router} keeps asking to be woken at {now} without progress")

    def _apply(self, router: int, decision: Decision, now: float, *, ticked: bool = True) -> None:
        """Carry out one core decision, as the driver would (`ticked`: it came from a tick, or an event that
        ticks, so its wake-up is all the core waits for)."""
        for settled in decision.settled:
            self._end(settled.request, now, settled.outcome)
        for worker_id, item_ids in decision.drops.items():
            self.workers[worker_id].drop(item_ids)
        for dispatch in decision.dispatches:
            self.batch_rows.append(dispatch.rows)
            self.cut_reasons[dispatch.reason] += 1
            for request in dispatch.requests:  # a loop, not `sum` over a generator: one call per batch
                if request.attempts > 1:
                    self.redispatched += 1
            worker = self.workers[dispatch.worker_id]
            started, busy = worker.accept(dispatch, router, now)
            if started is not None:
                self._push(started.ends, DONE, worker)
            if busy is not None:
                self._push(now, ANSWER, (router, worker.worker_id, busy))
        self._arm(router, decision.wake_at, now, ticked=ticked)

    def _arm(self, router: int, wake_at: float | None, now: float, *, ticked: bool) -> None:
        """As the driver's alarm: a tick's wake-up replaces the timer; another event's only brings it
        forward (a superseded timer never fires)."""
        armed = self._timer_at[router]
        earlier = wake_at is not None and (armed is None or wake_at < armed)
        if wake_at == armed or not (ticked or earlier):
            return
        self._timer_gen[router] += 1
        self._timer_at[router] = wake_at
        if wake_at is not None:
            self._push(max(wake_at, now) + TIMER_SLACK_S, TIMER, (router, self._timer_gen[router]))

    # -- events (public, so a scripted sequence can drive them: tests/unit/router/test_one_core.py) -------
    def tick(self, router: int, now: float) -> None:
        """A router's timer."""
        self._apply(router, self.cores[router].tick(now), now)

    def worker_left(self, worker_id: str, why: str, now: float) -> None:
        """Every router learns that a worker is gone."""
        for router, core in enumerate(self.cores):
            self._apply(router, core.worker_left(now, worker_id, why), now)

    def publish(self, router: int, now: float) -> None:
        """A router's publish round: what it publishes reaches the others after `demand_delay_ms`, and the
        router counts it in full `OWN_GRACE_S` after writing it (as router/peers.py does)."""
        demand = self.cores[router].publish_demand(now)
        if demand is not None:
            self._push(now + self.plan.scenario.demand_delay_ms / 1000.0, PEER, (router, demand))
            self._push(now + OWN_GRACE_S, COUNTED, router)

    def peer_published(self, router: int, demand: Demand, now: float) -> None:
        """A router's published demand reaches every other router."""
        self._published[f"r{router}"] = demand
        for other, core in enumerate(self.cores):
            if other != router:
                core.set_peers(now, self._peers_of(other))

    def _peers_of(self, router: int) -> dict[str, Demand]:
        own = f"r{router}"
        return {name: demand for name, demand in self._published.items() if name != own}

    def arrive(self, index: int, cls: int, now: float) -> None:
        """Arrival `index` (of class `cls`) reaches a router: the routers in turn, or the class's own."""
        deadline_s, input_bytes, cost, lane, limits, rows, tenant, priority, placement = self._per_class[cls]
        if placement is None:
            router = index % len(self.cores)
        else:
            router = placement[self._placed[cls] % len(placement)]
            self._placed[cls] += 1
        core = self.cores[router]
        request = core.new_request(
            now, lane=lane, rows=rows, deadline=now + deadline_s - self.overhead_s, payload=(index, cls),
            tenant=tenant, priority=priority, limits=limits, input_bytes=input_bytes, cost=cost,
        )  # fmt: skip
        self._apply(router, core.arrive(now, request), now, ticked=False)

    def _forward_done(self, worker: SimWorker, now: float) -> None:
        if not worker.alive or worker.running is None or worker.running.ends != now:
            return  # the worker crashed after this forward started: its answers never come
        done, following = worker.finish(now)
        if following is not None:
            self._push(following.ends, DONE, worker)
        self._late_rows(done, now)
        blind = not self.plan.scenario.workers_report_load
        for router, answer in worker.answers(done):
            told = replace(answer, queued_batches=None) if blind else answer
            self.answered(router, worker.worker_id, told, now)
        self._leave_if_drained(worker, now)

    def answered(self, router: int, worker_id: str, answer: BatchAnswer, now: float) -> None:
        """A worker's answer reaches the router that sent the batch."""
        self._apply(router, self.cores[router].answered(now, worker_id, answer), now)

    def _late_rows(self, done: Running, now: float) -> None:
        """Rows the device ran for requests that were past their deadline when the forward ended."""
        skipped, late = done.skipped, 0
        for held in done.batches:
            for r in held.dispatch.requests:  # a loop, not `sum` over a generator: one call per batch
                if now > r.deadline and r.request_id not in skipped:
                    late += r.rows
        self.late_rows += late

    def _report(self, now: float) -> None:
        for worker in self.workers.values():
            if worker.alive:
                for router, core in enumerate(self.cores):
                    decision = core.worker_reported(now, worker.worker_id, not worker.draining, worker.held)
                    self._apply(router, decision, now)

    def _leave_if_drained(self, worker: SimWorker, now: float) -> None:
        if worker.draining and worker.alive and worker.idle:
            worker.alive = False
            for router, core in enumerate(self.cores):
                self._apply(router, core.worker_left(now, worker.worker_id, "drained"), now)

    # -- outcomes -----------------------------------------------------------------------------------------
    def _end(self, request: QueuedRequest, now: float, outcome: Served | SluiceError) -> None:
        assert isinstance(request.payload, tuple)
        index, cls = request.payload
        if self._records[index] is not None:
            raise AssertionError(f"request {index} ended twice")
        arrival, deadline_s = request.arrival, self._per_class[cls][0]
        latency = now - arrival + self.overhead_s
        if isinstance(outcome, SluiceError):
            code, hint = outcome.code.name, outcome.retry_after_s is not None
            record = RequestRecord(cls, arrival, 0.0, latency, code, deadline_s, outcome.reason, hint)
        else:  # one record per request, built positionally: keywords cost more than the rest of it
            record = RequestRecord(cls, arrival, 0.0, latency, "OK", deadline_s)
        self._records[index] = record

    def _result(self, end_s: float, wall_s: float, cpu_s: float) -> SimResult:
        missing = [i for i, r in enumerate(self._records) if r is None]
        if missing:
            raise AssertionError(f"{len(missing)} request(s) never ended (first: {missing[0]})")
        records = [r for r in self._records if r is not None]
        workers = [
            WorkerStats(w.worker_id, w.speed, w.forwards, w.rows, w.busy_s, w.max_held)
            for w in self.workers.values()
        ]
        forwards = [rows for w in self.workers.values() for rows in w.forward_rows]
        return SimResult(
            plan=self.plan, records=records, workers=workers, batch_rows=self.batch_rows,
            forward_rows=forwards, cut_reasons=dict(self.cut_reasons), late_rows=self.late_rows,
            redispatched=self.redispatched, end_s=end_s, wall_s=wall_s, cpu_s=cpu_s,
            events=self.events,
        )  # fmt: skip


def simulate(plan: RunPlan) -> SimResult:
    """Run one plan."""
    return Simulation(plan).run()
