"""Every rule of the router core, under a fake clock: one event in, one decision out.

The rules (router/policy/core.py's docstring lists their homes): arrival pre-checks; batching and worker
choice (which workers get batches, and how many at once, this router's and every router's); deadlines
after dispatch and hung workers; the learning formula; breaker classification; late finish; re-dispatch
on loss, on a failed send and on a busy worker. (Which version serves a call: test_versions.py; a call's
deadline: test_deadline_budget.py.)
"""

from __future__ import annotations

import pytest

from sluice_inference.common.errors import SluiceError
from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.common.serving_settings import AdmissionSettings, RouterSettings, TenantSettings
from sluice_inference.router.policy.batcher import (
    NO_HOST_COST,
    BatchContext,
    Cut,
    HostCost,
    TimerBatcher,
    WakeAt,
)
from sluice_inference.router.policy.core import (
    BUSY,
    HANG_FACTOR,
    MAX_CAPPED_LIMITS,
    RouterCore,
    with_message_cap,
)
from sluice_inference.router.policy.lanes import Lane, LaneKey, LaneLimits
from sluice_inference.router.policy.outcomes import Served
from sluice_inference.router.policy.scheduler import ExpectedCompletion
from tests.support.garbage import cyclic_garbage
from tests.unit.router.core_support import (
    KEY,
    failed_answer,
    join,
    make_core,
    occupy,
    ok_answer,
    outcomes,
    request,
)

WIDE = LaneLimits(max_batch_size=8, max_wait_s=0.010)


@pytest.fixture
def core() -> RouterCore:
    """Two workers of m:1, each taking 2 batches at once, with the timer batcher and least-loaded choice."""
    made = make_core(admission=AdmissionSettings(estimate_margin=1.0, lane_max_queued=100))
    join(made, "w1")
    join(made, "w2")
    return made


# -- arrival ------------------------------------------------------------------------------------------
def test_a_refusal_is_kept_without_its_traceback_and_leaves_no_reference_cycle() -> None:
    """The frames of a caught refusal's traceback hold the decision that holds the error: kept with it,
    every refusal was a reference cycle of ~20 objects that only the cyclic collector frees."""
    core = RouterCore(
        0.0, settings=RouterSettings(), admission=AdmissionSettings(),
        tenants={"bronze": TenantSettings(rate=1.0, burst=1)}, batcher=TimerBatcher(),
    )  # fmt: skip
    join(core, "w1")
    core.arrive(0.0, request(0.0))  # the tenant's one token
    with cyclic_garbage() as garbage:
        refusals = [core.arrive(0.0, request(0.0)).settled[0].outcome for _ in range(50)]
    for refusal in refusals:
        assert isinstance(refusal, SluiceError) and refusal.reason == "tenant_rate"
        assert refusal.__traceback__ is None and refusal.__context__ is None
    assert garbage.found == 0


def test_a_request_whose_deadline_already_passed_ends_at_once(core: RouterCore) -> None:
    late = request(1.0, timeout=0.0)
    assert outcomes(core.arrive(1.0, late)) == {late.request_id: "DEADLINE_EXCEEDED/expired_on_arrival"}
    assert core.admission.limiter.inflight["bronze"] == 0


def test_a_request_no_accepting_worker_serves_is_refused_retryably() -> None:
    core = make_core()
    join(core, "w1", ready=False)  # registered draining
    lonely = request(0.0)
    decision = core.arrive(0.0, lonely)
    assert outcomes(decision) == {lonely.request_id: "UNAVAILABLE/no_worker"}
    assert decision.settled[0].outcome.retry_after_s  # type: ignore[union-attr]


# -- batching and worker choice ---------------------------------------------------------------------------


def test_idle_workers_get_work_immediately(core: RouterCore) -> None:
    decision = core.arrive(0.0, request(0.0))
    assert [d.reason for d in decision.dispatches] == ["idle_worker"]


def test_busy_workers_accumulate_until_max_wait(core: RouterCore) -> None:
    for _ in range(2):  # occupy one place on each worker
        core.arrive(0.0, request(0.0, limits=WIDE))
    for _ in range(3):
        assert core.arrive(0.0, request(0.0, limits=WIDE)).dispatches == []
    decision = core.tick(0.0)
    assert decision.wake_at == pytest.approx(WIDE.max_wait_s)
    decision = core.tick(WIDE.max_wait_s)
    assert [(d.rows, d.reason) for d in decision.dispatches] == [(3, "max_wait")]


def test_a_full_batch_leaves_without_waiting(core: RouterCore) -> None:
    for _ in range(2):
        core.arrive(0.0, request(0.0, limits=WIDE))
    dispatched = [
        d
        for _ in range(WIDE.max_batch_size + 3)
        for d in core.arrive(0.0, request(0.0, limits=WIDE)).dispatches
    ]
    assert [(d.rows, d.reason) for d in dispatched] == [(8, "full")]


def test_at_most_per_router_batches_on_each_worker(core: RouterCore) -> None:
    for _ in range(40):
        core.arrive(0.0, request(0.0, limits=WIDE))
    core.tick(0.5)
    assert {w.worker_id: w.in_flight_batches for w in core.workers} == {"w1": 2, "w2": 2}
    assert core.queues.queued() > 0


@pytest.mark.parametrize(
    ("device", "setting", "kept"), [("cpu", 0, 1), ("cuda:0", 0, 2), ("cpu", 2, 2), ("cuda", 1, 1)]
)
def test_batches_kept_on_a_worker_go_by_its_device_unless_configured(
    device: str, setting: int, kept: int
) -> None:
    core = make_core(settings=RouterSettings(batches_in_flight_per_worker=setting))
    join(core, "w1", capacity=8, device=device)
    for _ in range(40):
        core.arrive(0.0, request(0.0, limits=WIDE))
    core.tick(0.5)
    assert [w.in_flight_batches for w in core.workers] == [kept]  # a CPU forward overlaps no second batch


def test_other_routers_batches_count_against_a_workers_capacity() -> None:
    core = make_core(settings=RouterSettings(batches_in_flight_per_worker=2))
    join(core, "w1", capacity=3)
    join(core, "w2", capacity=3)
    core.worker_reported(0.0, "w1", True, queued_batches=3)  # other routers fill w1
    sent = [d.worker_id for _ in range(4) for d in core.arrive(0.0, request(0.0)).dispatches]
    assert set(sent) == {"w2"}  # w1 is full whatever this router holds there
    reported = core.worker_reported(0.1, "w1", True, queued_batches=1)  # they were answered
    assert [d.worker_id for d in reported.dispatches] == ["w1"]


def test_expected_completion_avoids_a_worker_other_routers_keep_busy() -> None:
    core = make_core(chooser=ExpectedCompletion())
    join(core, "w1", capacity=8)
    join(core, "w2", capacity=8)
    core.worker_reported(0.0, "w1", True, queued_batches=5)  # w1 holds 5 batches of other routers
    [dispatch] = core.arrive(0.0, request(0.0)).dispatches
    assert dispatch.worker_id == "w2"


def test_least_loaded_worker_is_chosen(core: RouterCore) -> None:
    first = core.arrive(0.0, request(0.0)).dispatches[0]
    second = core.arrive(0.0, request(0.0)).dispatches[0]
    assert {first.worker_id, second.worker_id} == {"w1", "w2"}
    core.answered(0.001, first.worker_id, ok_answer(first))
    third = core.arrive(0.001, request(0.001)).dispatches[0]
    assert third.worker_id == first.worker_id


def test_lanes_never_mix_shapes(core: RouterCore) -> None:
    other = LaneKey("m", "1", (("input", (128,)),))
    for _ in range(2):
        core.arrive(0.0, request(0.0, limits=WIDE))
    core.arrive(0.0, request(0.0, limits=WIDE))
    core.arrive(0.0, request(0.0, lane=other, limits=WIDE))
    batches = core.tick(WIDE.max_wait_s).dispatches
    assert sorted(d.lane for d in batches) == sorted([KEY, other])
    assert all(len(d.requests) == 1 for d in batches)


def test_a_draining_worker_gets_no_new_batches(core: RouterCore) -> None:
    core.worker_reported(0.0, "w1", False, queued_batches=0)  # its stream says DRAINING
    sent = {d.worker_id for _ in range(3) for d in core.arrive(0.0, request(0.0)).dispatches}
    assert sent == {"w2"}


def test_a_worker_takes_batches_only_once_registered_ready_connected_and_ready_on_its_stream() -> None:
    core = make_core()
    core.worker_registered(0.0, "w1", {("m", "1"): {}}, 2, True, device="cuda")
    assert not core.serves("m", "1")  # no stream yet
    core.worker_connected(0.0, "w1", True)
    assert core.serves("m", "1")
    core.worker_registered(0.0, "w1", {("m", "1"): {}}, 2, False, device="cuda")  # the record says draining
    assert not core.serves("m", "1")


def test_batches_are_cut_to_fit_the_worker_message_limit() -> None:
    core = make_core(admission=AdmissionSettings(estimate_margin=1.0, lane_max_queued=100))
    limits = LaneLimits(max_batch_size=8, max_wait_s=0.0, max_batch_bytes=10_000)
    busy = occupy(core)  # one worker, one batch at a time: the big requests queue behind it
    for _ in range(6):
        big = request(0.0, timeout=60, limits=limits)
        big.wire_bytes = 4_000
        core.arrive(0.0, big)
    sizes, answering = [], busy
    for step in range(4):
        next_batches = core.answered(0.01 * (step + 1), "w", ok_answer(answering)).dispatches
        if not next_batches:
            break
        [answering] = next_batches
        sizes.append(len(answering.requests))
    assert sizes == [2, 2, 2]  # 6 requests of 4,000 bytes under a 10,000-byte cap


def test_a_request_carries_its_model_limits_capped_by_the_message_limit() -> None:
    core = make_core(max_batch_bytes=10_000)
    spec = TensorSpec(name="x", datatype="FP32", dims=(4,))
    record = ModelRecord(name="m", version="1", digest="d", platform="synthetic", max_batch_size=8,
                         max_wait_s=0.003, max_batch_cost=64, inputs=(spec,), outputs=(spec,))  # fmt: skip
    made = core.new_request(
        0.0, lane=KEY, rows=1, deadline=1.0, payload=None, tenant="gold", priority=1,
        limits=LaneLimits.of(record),
    )  # fmt: skip
    assert made.limits == LaneLimits(8, 0.003, 64, 10_000)
    again = core.new_request(
        0.0, lane=KEY, rows=1, deadline=1.0, payload=None, tenant="gold", priority=1,
        limits=LaneLimits.of(record),
    )  # fmt: skip
    assert again.limits is made.limits  # derived once, not per request
    changed = record.model_copy(update={"max_batch_size": 4})
    made = core.new_request(
        0.0, lane=KEY, rows=1, deadline=1.0, payload=None, tenant="gold", priority=1,
        limits=LaneLimits.of(changed),
    )  # fmt: skip
    assert made.limits == LaneLimits(4, 0.003, 64, 10_000)  # a changed registration is followed
    bare = request(0.0)
    bare.limits = None
    with pytest.raises(ValueError, match="without its lane limits"):
        core.arrive(0.0, bare)


def test_the_limits_with_the_message_cap_are_remembered_boundedly() -> None:
    core = make_core(max_batch_bytes=10_000)
    for size in range(1, MAX_CAPPED_LIMITS + 2):
        made = core.new_request(
            0.0, lane=KEY, rows=1, deadline=1.0, payload=None, tenant="gold", priority=1,
            limits=LaneLimits(size, 0.0),
        )  # fmt: skip
        assert made.limits == LaneLimits(size, 0.0, None, 10_000)
    assert with_message_cap.cache_info().currsize <= MAX_CAPPED_LIMITS


class _BrokenBatcher:
    """The timer batcher, with a bug in one model's lanes (a wrapper: the compiled core's classes take no
    interpreted subclasses)."""

    def __init__(self) -> None:
        self._timer = TimerBatcher()

    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        if lane.key.model == "broken":
            raise ZeroDivisionError("a bug in one lane's decision")
        return self._timer.decide(lane, ctx)


def test_a_bug_in_one_lane_fails_that_lane_only() -> None:
    core = make_core(batcher=_BrokenBatcher())
    core.worker_registered(0.0, "w1", {("m", "1"): {}, ("broken", "1"): {}}, 2, True, device="cuda")
    core.worker_connected(0.0, "w1", True)
    broken = request(0.0, lane=LaneKey("broken", "1"))
    decision = core.arrive(0.0, broken)
    assert outcomes(decision) == {broken.request_id: "INTERNAL/internal"}
    fine = request(0.0)
    assert [r.request_id for d in core.arrive(0.0, fine).dispatches for r in d.requests] == [fine.request_id]


class _Recording:
    """The timer batcher, keeping every context it was asked with."""

    def __init__(self) -> None:
        self._timer = TimerBatcher()
        self.contexts: list[BatchContext] = []

    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        self.contexts.append(ctx)
        return self._timer.decide(lane, ctx)


def test_the_batcher_sees_the_host_cost_with_the_routers_arrival_rate_only_while_cpu_is_short() -> None:
    batcher = _Recording()
    core = make_core(batcher=batcher)
    join(core, "w", capacity=8)
    core.arrive(0.0, request(0.0))
    assert batcher.contexts[-1].host == NO_HOST_COST
    core.host_load(0.5, batch_s=0.002, row_s=0.0005, constrained=False, pressure=0.0)
    core.arrive(0.5, request(0.5))  # the worker now holds a batch: this one waits in the lane
    factor = core.settings.pressure_hold_factor
    assert batcher.contexts[-1].host == HostCost(0.002, 0.0005, False, 0.0, hold_factor=factor)  # no rate
    # its tick decides for the lane
    core.host_load(1.0, batch_s=0.002, row_s=0.0005, constrained=True, pressure=0.0)
    assert len(batcher.contexts) == 3
    host = batcher.contexts[-1].host
    assert host.constrained and (host.batch_s, host.row_s) == (0.002, 0.0005)
    assert host.rows_per_s == pytest.approx(core.queues.total_arrival_rate(1.0)) and host.rows_per_s > 0


@pytest.mark.parametrize("bad", [-0.001, 1.5, float("nan"), float("inf")])
def test_host_costs_outside_their_range_are_refused(bad: float) -> None:
    core = make_core()
    with pytest.raises(ValueError, match="host_load: row_s"):
        core.host_load(0.0, batch_s=0.001, row_s=bad, constrained=True, pressure=0.0)


# -- after dispatch -----------------------------------------------------------------------------------------


def test_a_dispatched_request_ends_at_its_deadline_even_if_its_worker_never_answers(core: RouterCore) -> None:
    early, later = request(0.0, timeout=0.05), request(0.0, timeout=0.2)
    sent = [d for r in (early, later) for d in core.arrive(0.0, r).dispatches]
    assert len(sent) == 2
    decision = core.tick(early.deadline)
    assert outcomes(decision) == {early.request_id: "DEADLINE_EXCEEDED/expired_on_worker"}
    [(worker, items)] = decision.drops.items()
    assert items == [early.request_id] and worker == sent[0].worker_id
    assert decision.wake_at == pytest.approx(later.deadline)
    assert core.tick(early.deadline).settled == []  # each request ends once
    assert outcomes(core.tick(later.deadline)) == {later.request_id: "DEADLINE_EXCEEDED/expired_on_worker"}
    late_answer = core.answered(later.deadline + 0.01, sent[1].worker_id, ok_answer(sent[1]))
    assert late_answer.settled == []  # the answer that comes after is owed to no one


def test_a_worker_that_holds_work_and_answers_nothing_is_lost() -> None:
    core = make_core(settings=RouterSettings(worker_hang_s=5.0))
    join(core, "w1")
    held = request(0.0, timeout=60)
    [sent] = core.arrive(0.0, held).dispatches
    join(core, "w2")
    assert core.tick(4.9).lost == []
    decision = core.tick(5.0)
    assert decision.lost == ["w1"] and "w1" not in core.workers
    # its request was queued again, and went to the other worker in the same decision
    assert [(d.worker_id, [r.request_id for r in d.requests]) for d in decision.dispatches] == [
        ("w2", [held.request_id])
    ]
    assert sent.worker_id == "w1"


def test_a_long_batch_gets_ten_times_its_estimate_before_it_counts_as_hung() -> None:
    core = make_core(settings=RouterSettings(worker_hang_s=0.1))
    join(core, "w1")
    [sent] = core.arrive(0.0, request(0.0, timeout=60)).dispatches
    assert core.tick(HANG_FACTOR * sent.expected_s * 0.99).lost == []
    assert core.tick(HANG_FACTOR * sent.expected_s).lost == ["w1"]


def test_an_idle_worker_is_never_hung(core: RouterCore) -> None:
    assert core.tick(3600).lost == []


# -- answers ------------------------------------------------------------------------------------------------


def test_learning_measures_from_when_the_worker_could_start_the_batch(core: RouterCore) -> None:
    first, second = (core.arrive(0.0, request(0.0, rows=4)).dispatches[0] for _ in range(2))
    assert first.worker_id != second.worker_id
    third = core.arrive(0.0, request(0.0, rows=4)).dispatches[0]  # queued behind `first`
    decision = core.answered(0.020, first.worker_id, ok_answer(first, execute_s=0.004))
    [learned] = decision.learned
    assert learned.seconds == pytest.approx(0.020)  # sent to an idle worker at 0: the whole 20 ms
    decision = core.answered(0.030, third.worker_id, ok_answer(third, execute_s=0.004))
    [learned] = decision.learned
    assert learned.seconds == pytest.approx(0.010)  # from the previous answer, not from when it was sent
    slow = core.answered(0.031, second.worker_id, ok_answer(second, execute_s=0.050))
    assert slow.learned[0].seconds == pytest.approx(0.050)  # the forward, when it is longer


def test_only_failures_the_worker_blames_on_itself_open_its_breaker(core: RouterCore) -> None:
    for _ in range(5):  # batches of nothing but bad items: the client's fault
        [sent] = core.arrive(0.0, request(0.0)).dispatches
        decision = core.answered(0.0, sent.worker_id, failed_answer(sent, worker_fault=False))
        assert set(outcomes(decision).values()) == {"INTERNAL/worker_error"}
    assert all(core.breaker.allows(w, 0.0) for w in ("w1", "w2"))
    for _ in range(3):
        occupied = core.arrive(0.0, request(0.0)).dispatches
        for sent in occupied:
            core.answered(0.0, sent.worker_id, failed_answer(sent, worker_fault=True))
    blamed = [w for w in ("w1", "w2") if not core.breaker.allows(w, 0.0)]
    assert blamed  # three failures it blames on itself: its breaker opens ...
    assert all(d.worker_id not in blamed for _ in range(3) for d in core.arrive(0.0, request(0.0)).dispatches)


def test_an_answer_after_the_deadline_is_deadline_exceeded_never_ok(core: RouterCore) -> None:
    slow = request(0.0, timeout=0.05)
    [sent] = core.arrive(0.0, slow).dispatches
    # answered a hair after the deadline, before the core was ticked for it
    answer = core.answered(0.0501, sent.worker_id, ok_answer(sent))
    assert outcomes(answer) == {slow.request_id: "DEADLINE_EXCEEDED/finished_late"}


def test_an_ok_answer_carries_the_outputs_and_how_it_was_served(core: RouterCore) -> None:
    fine = request(0.0)
    [sent] = core.arrive(0.001, fine).dispatches
    [settled] = core.answered(0.01, sent.worker_id, ok_answer(sent)).settled
    assert isinstance(settled.outcome, Served)
    assert settled.outcome.outputs == [f"out-{fine.request_id}"]
    assert settled.outcome.worker_id == sent.worker_id
    assert core.admission.limiter.inflight["bronze"] == 0


# -- lost work ----------------------------------------------------------------------------------------------


def test_a_lost_workers_requests_are_dispatched_once_more_then_fail(core: RouterCore) -> None:
    lost = request(0.0, timeout=10)
    [first] = core.arrive(0.0, lost).dispatches
    decision = core.worker_left(0.01, first.worker_id, "stream broke")
    [again] = decision.dispatches
    assert [r.request_id for r in again.requests] == [lost.request_id] and again.worker_id != first.worker_id
    assert lost.attempts == 2
    decision = core.worker_left(0.02, again.worker_id, "stream broke")
    assert outcomes(decision) == {lost.request_id: "UNAVAILABLE/worker_lost"}


def test_a_lost_request_past_its_latest_start_fails_at_once(core: RouterCore) -> None:
    tight = request(0.0, timeout=0.05)
    [sent] = core.arrive(0.0, tight).dispatches
    decision = core.worker_left(tight.latest_start, sent.worker_id, "stream broke")
    assert outcomes(decision) == {tight.request_id: "UNAVAILABLE/worker_lost"}


def test_a_batch_that_could_not_be_sent_is_dispatched_once_more(core: RouterCore) -> None:
    unsent = request(0.0, timeout=10)
    [first] = core.arrive(0.0, unsent).dispatches
    decision = core.send_failed(0.0, first.batch_id, "no open stream")
    [again] = decision.dispatches
    assert [r.request_id for r in again.requests] == [unsent.request_id]
    assert first.batch_id not in core.in_flight and unsent.attempts == 2


def test_a_busy_worker_sends_the_batch_elsewhere_without_using_up_its_retry(core: RouterCore) -> None:
    bounced = request(0.0, timeout=10)
    [first] = core.arrive(0.0, bounced).dispatches
    decision = core.answered(0.001, first.worker_id, failed_answer(first, worker_fault=False, reason=BUSY))
    assert decision.settled == [] and bounced.attempts == 1
    assert [r.request_id for d in decision.dispatches for r in d.requests] == [bounced.request_id]
    assert core.breaker.allows(first.worker_id, 0.001)


def test_cancelled_in_flight_request_is_dropped_on_its_worker(core: RouterCore) -> None:
    gone = request(0.0)
    [sent] = core.arrive(0.0, gone).dispatches
    decision = core.cancel(0.001, gone.request_id)
    assert outcomes(decision) == {gone.request_id: "CANCELLED/cancelled"}
    assert decision.drops == {sent.worker_id: [gone.request_id]}
    assert core.answered(0.002, sent.worker_id, ok_answer(sent)).settled == []


def test_a_cancelled_request_leaves_the_queue() -> None:
    core = make_core()
    occupy(core)
    gone = request(0.0)
    core.arrive(0.0, gone)
    assert outcomes(core.cancel(0.0, gone.request_id)) == {gone.request_id: "CANCELLED/cancelled"}
    assert core.cancel(0.0, gone.request_id).settled == [] and core.queues.queued() == 0
