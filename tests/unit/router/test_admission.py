"""Admission through the router core, under a fake clock: deadline budgets, classification (terminal only
below the best case, retryable when the current state is to blame), bounds with eviction, early removal,
cancellation, the unbounded baseline."""

from __future__ import annotations

import pytest

from sluice_inference.common.errors import SluiceError
from sluice_inference.common.serving_settings import AdmissionSettings
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.lanes import LaneKey, LaneLimits, QueuedRequest
from sluice_inference.router.policy.outcomes import Decision
from tests.unit.router.core_support import join, make_core, occupy, outcomes, request

WARMUP = {1: 0.011, 4: 0.014}
"""Warm-up timings of m:1, the same profile make_core's estimates learned: best case t(1) = 11 ms."""


def test_latest_start_budgets_for_a_full_batch_and_one_batch_ahead_on_the_worker() -> None:
    core = make_core()
    join(core, "w")
    held = request(0.0, timeout=1.0)
    core.arrive(0.0, held)
    assert held.latest_start == pytest.approx(1.0 - 2 * 0.014 - 0.1)  # two full batches, 10 % reserve
    tight = request(0.0, timeout=0.020)  # only an immediate start makes it: no room for a batch ahead
    core.arrive(0.0, tight)
    assert tight.latest_start == pytest.approx(0.020 - 0.011)


def refusal(decision: Decision, request: QueuedRequest) -> SluiceError:
    """The typed error `request` was refused with (the decision settles nothing else)."""
    [settled] = decision.settled
    assert settled.request is request and isinstance(settled.outcome, SluiceError)
    return settled.outcome


def join_warmed(core: RouterCore, worker_id: str = "w") -> None:
    """A worker of m:1 joins with its warm-up timings (they set the best-case floor)."""
    core.worker_registered(0.0, worker_id, {("m", "1"): WARMUP}, 2, True, device="cuda")
    core.worker_connected(0.0, worker_id, True)


def test_deadline_below_best_case_is_terminal_and_names_the_limit() -> None:
    core = make_core()
    join_warmed(core)
    too_short = request(0.0, timeout=0.010)  # idle system, best case 11 ms for one row
    error = refusal(core.arrive(0.0, too_short), too_short)
    assert (error.code.name, error.reason) == ("INVALID_ARGUMENT", "deadline_too_short")
    assert not error.retryable and error.retry_after_s is None
    assert "10.0 ms" in error.message and "best-case service time (~11.0 ms for 1 row(s))" in error.message
    assert core.admission.limiter.inflight["bronze"] == 0  # refused: its quota slot came back


def test_deadline_spent_waiting_in_the_router_is_retryable() -> None:
    core = make_core()
    join_warmed(core)
    late = request(0.0, timeout=0.050)  # the client allowed 50 ms: well above the 11 ms best case
    error = refusal(core.arrive(0.045, late), late)  # but it reached admission with 5 ms left
    assert (error.code.name, error.reason) == ("UNAVAILABLE", "deadline_unmeetable_now")
    assert error.retryable and error.retry_after_s == pytest.approx(0.011)  # one estimated batch
    assert "45.0 ms spent in the router" in error.message


def test_a_short_budget_is_retryable_while_the_routers_cpu_is_short() -> None:
    core = make_core()
    join_warmed(core)
    core.host_load(0.0, batch_s=0.0, row_s=0.0, constrained=False, pressure=0.9)
    # What reaches the core with 10 ms left may have waited in gRPC's queue for the rest of its budget:
    # the router cannot tell, so it is not the client's error.
    short = request(0.0, timeout=0.010)
    error = refusal(core.arrive(0.0, short), short)
    assert (error.code.name, error.reason) == ("UNAVAILABLE", "deadline_unmeetable_now")
    assert error.retryable
    core.host_load(0.1, batch_s=0.0, row_s=0.0, constrained=False, pressure=0.5)  # the CPU no longer short
    again = request(0.1, timeout=0.010)
    error = refusal(core.arrive(0.1, again), again)
    assert (error.code.name, error.reason) == ("INVALID_ARGUMENT", "deadline_too_short")


def test_load_inflated_estimates_refuse_retryably_but_below_best_case_stays_terminal() -> None:
    core = make_core()
    join_warmed(core)
    for _ in range(100):  # under load the batches now take ~80 ms: the learned t(n) follows
        for rows in (1, 4):
            core.estimates.observe("m", "1", rows, 0.079 + 0.001 * rows)
    assert core.estimates.batch_seconds("m", "1", 1) == pytest.approx(0.080, rel=0.01)
    fits_best_case = request(0.0, timeout=0.050)
    error = refusal(core.arrive(0.0, fits_best_case), fits_best_case)
    assert (error.code.name, error.reason) == ("UNAVAILABLE", "deadline_unmeetable_now")
    assert error.retryable and error.retry_after_s == pytest.approx(0.080, rel=0.01)
    below_best_case = request(0.0, timeout=0.010)
    error = refusal(core.arrive(0.0, below_best_case), below_best_case)
    assert (error.code.name, error.reason) == ("INVALID_ARGUMENT", "deadline_too_short")
    assert not error.retryable


def test_the_safety_margin_alone_never_makes_a_refusal_terminal() -> None:
    core = make_core(admission=AdmissionSettings(estimate_margin=1.5, lane_max_queued=4))
    join_warmed(core)
    tight = request(0.0, timeout=0.015)  # above the 11 ms best case, below t(1) x margin = 16.5 ms
    error = refusal(core.arrive(0.0, tight), tight)
    assert (error.code.name, error.reason) == ("UNAVAILABLE", "deadline_unmeetable_now")
    assert error.retryable and error.retry_after_s == pytest.approx(0.0165)


def test_a_version_never_timed_has_no_floor_so_nothing_is_terminal() -> None:
    core = make_core()
    core.worker_registered(0.0, "w", {("n", "1"): {}}, 2, True, device="cuda")
    core.worker_connected(0.0, "w", True)
    unknown = request(0.0, timeout=0.001, lane=LaneKey("n", "1"))  # below the 5 ms prior, but unmeasured
    error = refusal(core.arrive(0.0, unknown), unknown)
    assert (error.code.name, error.reason) == ("UNAVAILABLE", "deadline_unmeetable_now")
    assert error.retryable and error.retry_after_s


def test_deadline_infeasible_only_because_of_load_is_unavailable_with_drain_hint() -> None:
    core = make_core()
    join(core, "w", capacity=1)
    for _ in range(7):  # the worker takes one batch of 4; 3 wait
        core.arrive(0.0, request(0.0, timeout=10.0, priority=1, tenant="gold"))
    hopeless = request(0.0, timeout=0.020, priority=1, tenant="gold")
    decision = core.arrive(0.0, hopeless)
    error = refusal(decision, hopeless)
    assert (error.code.name, error.reason) == ("UNAVAILABLE", "deadline_unmeetable_now")
    assert error.retryable
    assert error.retry_after_s == pytest.approx(0.014 + 0.014, rel=0.01)  # one batch queued + one running


def test_full_lane_evicts_lower_priority_newest_first_and_refuses_equals() -> None:
    core = make_core()
    occupy(core)  # nothing drains: the lane fills up
    bronze = [request(0.0, 10.0) for _ in range(4)]
    for held in bronze:
        assert core.arrive(0.0, held).settled == []
    extra = request(0.0, 10.0)
    assert outcomes(core.arrive(0.0, extra)) == {extra.request_id: "UNAVAILABLE/queue_full"}
    gold = request(0.0, 10.0, tenant="gold", priority=1)
    decision = core.arrive(0.0, gold)
    assert outcomes(decision) == {bronze[-1].request_id: "UNAVAILABLE/shed"}
    assert decision.settled[0].outcome.retry_after_s  # type: ignore[union-attr]
    assert core.queues.queued() == 4


def test_byte_bound_evicts_across_lanes() -> None:
    settings = AdmissionSettings(estimate_margin=1.0, lane_max_queued=100, max_queued_bytes=1024)
    core = make_core(admission=settings)
    occupy(core)
    for _ in range(3):
        core.arrive(0.0, request(0.0, 10.0, size=300))
    refused = request(0.0, 10.0, size=300)
    assert outcomes(core.arrive(0.0, refused)) == {refused.request_id: "UNAVAILABLE/queue_full"}
    evicted = core.arrive(0.0, request(0.0, 10.0, tenant="gold", priority=1, size=600))
    assert len(evicted.settled) == 2 and core.queues.queued_bytes() == 900


def test_queued_request_is_dropped_when_it_can_no_longer_meet_its_deadline() -> None:
    core = make_core()
    join(core, "w", capacity=1)
    core.arrive(0.0, request(0.0, timeout=5.0))  # the only worker takes it: the lane cannot drain
    waiting = request(0.0, timeout=0.5)
    decision = core.arrive(0.0, waiting)
    assert decision.settled == [] and decision.wake_at == pytest.approx(waiting.latest_start)
    shed = core.tick(waiting.latest_start)
    assert outcomes(shed) == {waiting.request_id: "UNAVAILABLE/deadline_unmeetable"}
    assert waiting.latest_start < waiting.deadline
    late = request(0.0, timeout=0.5)
    core.arrive(0.0, late)
    assert outcomes(core.tick(late.deadline)) == {late.request_id: "DEADLINE_EXCEEDED/expired_in_queue"}


def test_cancellation_removes_from_queue_and_frees_inflight() -> None:
    core = make_core()
    occupy(core)
    queued = request(0.0, 10.0)
    core.arrive(0.0, queued)
    assert core.admission.limiter.inflight["bronze"] == 1
    assert outcomes(core.cancel(0.1, queued.request_id)) == {queued.request_id: "CANCELLED/cancelled"}
    assert core.admission.limiter.inflight["bronze"] == 0 and core.queues.queued() == 0


def test_disabled_admission_is_an_unbounded_fifo() -> None:
    core = make_core(admission=AdmissionSettings(enabled=False, lane_max_queued=1))
    occupy(core)
    for _ in range(50):
        assert core.arrive(0.0, request(0.0, 0.001)).settled == []
    assert core.queues.queued() == 50


def test_batcher_cuts_before_the_tightest_budget_runs_out() -> None:
    core = make_core()
    join(core, "w", capacity=2)
    core.arrive(0.0, request(0.0, timeout=5.0))  # one slot taken: not idle, no work-conserving cut
    patient = LaneLimits(max_batch_size=4, max_wait_s=10.0)
    waiting = request(0.0, timeout=0.100, limits=patient)
    decision = core.arrive(0.0, waiting)
    growth = 0.003  # t(4) - t(1): a fuller batch would take this much longer
    assert decision.dispatches == [] and decision.wake_at is not None
    assert decision.wake_at == pytest.approx(waiting.latest_start - growth)
    assert [d.reason for d in core.tick(decision.wake_at).dispatches] == ["deadline"]
