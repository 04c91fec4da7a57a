"""The event loop: the second driver of the policy core, under virtual time (DESIGN.md §3).

It makes the calls `router/driver.py` makes, on the same events, to the same objects:
- arrival → refuse at once if the deadline passed or no worker serves the model, else
  `AdmissionController.admit` (a SluiceError is a refusal; evicted requests end with their error);
- batch answered → `Dispatcher.complete(batch, now)`, `ServiceEstimates.observe` with the worker's id and
  the lane's shape, `breaker.success`, then per request: skipped by the worker or past its deadline →
  DEADLINE_EXCEEDED, else OK after `Dispatcher.finished`;
- worker crash noticed → `Dispatcher.worker_left` and `breaker.failure`; each lost request is dispatched
  once more (`resubmit`) while its latest start allows, else it ends UNAVAILABLE (worker_lost); drain →
  `worker_accepting(False)`, then `worker_left` once the worker is idle;
- after every event, `Dispatcher.poll(now)`: rejected requests end, dispatches go to the simulated
  workers, and the one timer is re-armed at `wake_at` (a timer superseded by a later poll never fires,
  as the driver's single `wait_for` would not). What the batcher sees of the receiving worker (idle, and
  when it should be free) comes from the dispatcher's own worker slots, as in the router.
Time only moves by jumping to the next event, so a run is deterministic for a seed and as fast as the
policy code allows.

Invariant: every arrival ends exactly once — OK, or a SluiceError's status and reason — and the admission
slot of an admitted request is released exactly when it ends. `run` raises if any request ended twice or
never ended.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import Counter

from bench.loadgen_stats import RequestRecord
from bench.sim.plan import RunPlan
from bench.sim.results import SimResult, WorkerStats
from bench.sim.scenario import Failure, worker_ids
from bench.sim.workers import Running, SimWorker, class_of
from common.config import AdmissionSettings, TenantSettings
from common.errors import DeadlineExceeded, SluiceError, Unavailable
from router.policy.admission import AdmissionController, queue_bounds
from router.policy.batcher import AdaptiveBatcher, Batcher, TimerBatcher
from router.policy.dispatcher import Dispatch, Dispatcher
from router.policy.estimators import ServiceEstimates
from router.policy.lanes import QueuedRequest
from router.policy.scheduler import make_chooser

ARRIVAL, DONE, TIMER, CRASH, NOTICED, DRAIN = range(6)
UNLIMITED = TenantSettings(rate=1e12, burst=10**12, max_inflight=10**12, default_priority=9, max_priority=1)
SETTLE_S = 60.0
"""After the last arrival plus the longest deadline, a run that still has events is broken: stop."""
MAX_SPINS = 1000
TIMER_SLACK_S = 1e-6
"""A timer fires this long after `wake_at`, as a real one never fires early. (The core compares `now` with
the very instants it asks to be woken at, so it needs no slack to make progress; `run` stops a core that
asks for the same instant over and over.)"""
BYTES_PER_ROW_ITEM = 4
"""FP32: a request's queued bytes are rows x length x 4 (admission's byte bound)."""


class Simulation:
    """One run of a plan. Use once: `Simulation(plan).run()`."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        scenario = plan.scenario
        model = scenario.model
        seed = scenario.seed
        self.overhead_s = scenario.overhead_ms / 1000.0
        self.classes = scenario.classes
        batcher: Batcher = AdaptiveBatcher() if plan.policy.batcher == "adaptive" else TimerBatcher()
        settings = AdmissionSettings(
            enabled=plan.policy.admission, lane_max_queued=plan.policy.lane_max_queued
        )
        self.dispatcher = Dispatcher(
            batcher=batcher,
            chooser=make_chooser(plan.policy.scheduler, random.Random(seed)),
            estimates=ServiceEstimates(),
            bounds=queue_bounds(settings),
            aging_s=settings.aging_s,
        )
        tenants = {c.tenant: UNLIMITED for c in scenario.classes}
        self.admission = AdmissionController(settings, tenants, self.dispatcher, now=0.0)
        served = self._seed_estimates()
        costs = [c.item_cost for c in scenario.classes]
        self.workers: dict[str, SimWorker] = {}
        ids = iter(worker_ids(scenario.workers))
        for index, group in enumerate(scenario.workers):
            for k in range(group.count):
                worker_id = next(ids)
                rng = random.Random(seed * 1_000_003 + index * 100_003 + k)
                self.workers[worker_id] = SimWorker(
                    worker_id,
                    group.speed,
                    model,
                    scenario.noise,
                    costs,
                    rng,
                    scenario.batch_overhead_ms / 1000,
                )
                self.dispatcher.worker_joined(worker_id, served, group.capacity)
                self.dispatcher.worker_accepting(worker_id, True)
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        for failure in scenario.failures:
            kind = CRASH if failure.kind == "crash" else DRAIN
            self._push(failure.at_s, kind, failure)
        self._timer_at: float | None = None
        self._timer_gen = 0
        self._last_fired = -1.0
        self._spins = 0
        self._records: list[RequestRecord | None] = [None] * plan.arrivals
        self._admitted: set[int] = set()
        self.batch_rows: list[int] = []
        self.cut_reasons: Counter[str] = Counter()
        self.late_rows = 0
        self.redispatched = 0
        self.events = 0

    def _seed_estimates(self) -> set[tuple[str, str]]:
        """Seed the model as the workers' warm-up timings would (a speed-1 device, batch sizes 1 and max, on
        the smallest shape bucket, as `worker/main.py` times them); returns what the workers serve."""
        model = self.plan.scenario.model
        smallest = min(self.classes, key=lambda c: c.length)
        warmup = {rows: model.batch_seconds(rows, smallest.item_cost) for rows in (1, model.max_batch_size)}
        self.dispatcher.estimates.seed(model.name, model.version, warmup)
        return {(model.name, model.version)}

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Run every arrival to its end; returns the outcomes."""
        started = time.perf_counter()
        times, classes = self.plan.times_s, self.plan.classes
        longest = max(c.deadline_ms for c in self.classes) / 1000.0
        stop_at = self.plan.scenario.duration_s + longest + SETTLE_S
        i, n = 0, len(times)
        now = 0.0
        while True:
            next_arrival = times[i] if i < n else math.inf
            next_event = self._events[0][0] if self._events else math.inf
            if math.isinf(next_arrival) and math.isinf(next_event):
                break
            if next_arrival <= next_event:
                now = next_arrival
                self._arrive(i, classes[i], now)
                i += 1
            else:
                now, _, kind, data = heapq.heappop(self._events)
                if now > stop_at:
                    break
                if kind == TIMER:
                    if data != self._timer_gen:
                        continue  # superseded: the driver would not have woken
                    self._fired(now)
                self._handle(kind, data, now)
            self.events += 1
            self._poll(now)
        return self._result(now, time.perf_counter() - started)

    def _fired(self, now: float) -> None:
        """The timer fired; a core that asks to be woken at the same instant forever is a bug: stop."""
        self._timer_at = None
        self._spins = self._spins + 1 if now == self._last_fired else 0
        self._last_fired = now
        if self._spins > MAX_SPINS:
            raise AssertionError(f"poll keeps asking to be woken at {now} without progress")

    def _push(self, when: float, kind: int, data: object) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, data))

    def _handle(self, kind: int, data: object, now: float) -> None:
        if kind == DONE:
            assert isinstance(data, SimWorker)
            self._batch_done(data, now)
        elif kind == CRASH:
            assert isinstance(data, Failure)
            self._crash(data, now)
        elif kind == NOTICED:
            assert isinstance(data, str)
            self._worker_lost(data, now)
        elif kind == DRAIN:
            assert isinstance(data, Failure)
            worker = self.workers[data.worker]
            worker.draining = True
            self.dispatcher.worker_accepting(worker.worker_id, False)
            self._leave_if_drained(worker)

    def _poll(self, now: float) -> None:
        decision = self.dispatcher.poll(now)
        for request, error in decision.rejected:
            self._end(request, now, error)
        for dispatch in decision.dispatches:
            self._send(dispatch, now)
        self._arm(decision.wake_at, now)

    def _arm(self, wake_at: float | None, now: float) -> None:
        if wake_at == self._timer_at:
            return
        self._timer_gen += 1
        self._timer_at = wake_at
        if wake_at is not None:
            self._push(max(wake_at, now) + TIMER_SLACK_S, TIMER, self._timer_gen)

    # -- events -------------------------------------------------------------------------------------------
    def _arrive(self, index: int, cls: int, now: float) -> None:
        spec = self.classes[cls]
        deadline = now + spec.deadline_ms / 1000.0 - self.overhead_s
        lane = self.plan.lanes[cls]
        length = lane.shape[0][1][0]  # the padded length: the lane's shape bucket
        request = QueuedRequest(
            index, lane, spec.rows, now, deadline, cls, tenant=spec.tenant, priority=spec.priority,
            size_bytes=spec.rows * length * BYTES_PER_ROW_ITEM, cost=spec.rows * length,
        )  # fmt: skip
        if deadline <= now:
            self._end(
                request, now, DeadlineExceeded("deadline passed on arrival", reason="expired_on_arrival")
            )
            return
        if not self.dispatcher.serves(lane.model, lane.version):
            self._end(request, now, Unavailable("no ready worker", reason="no_worker", retry_after_s=1.0))
            return
        try:
            evicted = self.admission.admit(request, self.plan.limits[cls], now)
        except SluiceError as refused:
            self._end(request, now, refused)
            return
        self._admitted.add(index)
        for victim, error in evicted:
            self._end(victim, now, error)

    def _send(self, dispatch: Dispatch, now: float) -> None:
        self.batch_rows.append(dispatch.rows)
        self.cut_reasons[dispatch.reason] += 1
        worker = self.workers[dispatch.worker_id]
        started = worker.accept(dispatch, now)
        if started is not None:
            self._push(started.ends, DONE, worker)

    def _batch_done(self, worker: SimWorker, now: float) -> None:
        if not worker.alive or worker.running is None or worker.running.ends != now:
            return  # the worker crashed after this batch started: its answer never comes
        done, following = worker.finish(now)
        if following is not None:
            self._push(following.ends, DONE, worker)
        self._answer(worker, done, now)
        self._leave_if_drained(worker)

    def _answer(self, worker: SimWorker, done: Running, now: float) -> None:
        dispatch = self.dispatcher.complete(done.dispatch.batch_id, now)
        if dispatch is None:
            return  # already handed back by worker_left
        key = dispatch.lane
        if done.executed_rows:
            seconds = done.ends - done.started
            estimates, worker_id = self.dispatcher.estimates, worker.worker_id
            estimates.observe(key.model, key.version, done.executed_rows, seconds, worker_id, shape=key.shape)
        self.dispatcher.breaker.success(worker.worker_id)  # simulated items never fail INTERNAL
        for request in dispatch.requests:
            if request.request_id in done.skipped:
                self._end(request, now, DeadlineExceeded("budget ran out before the batch started",
                                                         reason="expired_on_worker"))  # fmt: skip
            elif now > request.deadline:
                self.late_rows += request.rows
                self._end(
                    request, now, DeadlineExceeded("finished after its deadline", reason="finished_late")
                )
            else:
                self.dispatcher.finished(request, now)
                self._end(request, now, None)

    def _worker_lost(self, worker_id: str, now: float) -> None:
        """The router notices a lost worker: each of its requests is dispatched once more elsewhere while
        its latest start allows, else it ends UNAVAILABLE (as `Driver.worker_lost` does)."""
        lost = self.dispatcher.worker_left(worker_id)
        if lost:
            self.dispatcher.breaker.failure(worker_id, now)
        error = Unavailable(f"worker {worker_id} was lost before answering", reason="worker_lost",
                            retry_after_s=0.1)  # fmt: skip
        for dispatch in lost:
            for request in dispatch.requests:
                if request.attempts > 1 or now >= request.latest_start:
                    self._end(request, now, error)
                    continue
                self.redispatched += 1
                try:
                    evicted = self.dispatcher.resubmit(request, self.plan.limits[class_of(request)])
                except SluiceError as refused:
                    self._end(request, now, refused)
                    continue
                for victim, reason in evicted:
                    self._end(victim, now, reason)

    def _crash(self, failure: Failure, now: float) -> None:
        worker = self.workers[failure.worker]
        worker.crash()
        self._push(now + failure.detect_ms / 1000.0, NOTICED, worker.worker_id)

    def _leave_if_drained(self, worker: SimWorker) -> None:
        if worker.draining and worker.alive and worker.idle:
            worker.alive = False
            assert not self.dispatcher.worker_left(worker.worker_id)

    # -- outcomes -----------------------------------------------------------------------------------------
    def _end(self, request: QueuedRequest, now: float, error: SluiceError | None) -> None:
        index = request.request_id
        if self._records[index] is not None:
            raise AssertionError(f"request {index} ended twice")
        if index in self._admitted:
            self._admitted.discard(index)
            self.admission.release(request)
        cls = self.plan.classes[index]
        self._records[index] = RequestRecord(
            cls=cls, scheduled_s=request.arrival, lag_s=0.0,
            latency_s=now - request.arrival + self.overhead_s,
            code="OK" if error is None else error.code.name,
            deadline_s=self.classes[cls].deadline_ms / 1000.0,
            reason="" if error is None else error.reason,
            hint=error is not None and error.retry_after_s is not None,
        )  # fmt: skip

    def _result(self, end_s: float, wall_s: float) -> SimResult:
        missing = [i for i, r in enumerate(self._records) if r is None]
        if missing:
            raise AssertionError(f"{len(missing)} request(s) never ended (first: {missing[0]})")
        records = [r for r in self._records if r is not None]
        workers = [
            WorkerStats(w.worker_id, w.speed, w.batches, w.rows, w.busy_s) for w in self.workers.values()
        ]
        return SimResult(
            plan=self.plan, records=records, workers=workers, batch_rows=self.batch_rows,
            cut_reasons=dict(self.cut_reasons), late_rows=self.late_rows, redispatched=self.redispatched,
            end_s=end_s, wall_s=wall_s, events=self.events,
        )  # fmt: skip


def simulate(plan: RunPlan) -> SimResult:
    """Run one plan."""
    return Simulation(plan).run()
