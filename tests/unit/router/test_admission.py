"""Admission under a fake clock: deadline budgets, classification, bounds with eviction, early removal."""

from __future__ import annotations

import itertools

import pytest

from common.clock import FakeClock
from common.config import AdmissionSettings, TenantSettings
from common.errors import Code, SluiceError
from router.policy.admission import AdmissionController, queue_bounds
from router.policy.batcher import TimerBatcher
from router.policy.dispatcher import Dispatcher
from router.policy.lanes import LaneKey, LaneLimits, QueuedRequest

KEY = LaneKey("m", "1")
LIMITS = LaneLimits(max_batch_size=4, max_wait_s=0.002)
_ids = itertools.count(1)


def make(settings: AdmissionSettings | None = None, clock: FakeClock | None = None) -> AdmissionController:
    settings = settings or AdmissionSettings(estimate_margin=1.0, lane_max_queued=4)
    dispatcher = Dispatcher(TimerBatcher(), bounds=queue_bounds(settings), aging_s=settings.aging_s)
    for _ in range(20):  # t(n) = 10 ms + 1 ms·n, learned from "worker reports"
        for rows in (1, 4):
            dispatcher.estimates.observe("m", "1", rows, 0.010 + 0.001 * rows)
    dispatcher.worker_joined("w", {("m", "1")}, capacity=1)
    dispatcher.worker_accepting("w", True)
    tenants = {"gold": TenantSettings(rate=1e6, burst=10**6), "bronze": TenantSettings(rate=1e6, burst=10**6)}
    return AdmissionController(settings, tenants, dispatcher, now=(clock or FakeClock()).now())


def req(
    now: float, timeout: float, tenant: str = "bronze", priority: int = 3, size: int = 100
) -> QueuedRequest:
    return QueuedRequest(
        next(_ids), KEY, 1, now, now + timeout, tenant=tenant, priority=priority, size_bytes=size
    )


def refused(admission: AdmissionController, request: QueuedRequest, now: float = 0.0) -> SluiceError:
    with pytest.raises(SluiceError) as caught:
        admission.admit(request, LIMITS, now)
    return caught.value


def test_latest_start_budgets_for_a_full_batch_and_one_batch_ahead_on_the_worker() -> None:
    admission = make()
    request = req(0.0, timeout=1.0)
    admission.admit(request, LIMITS, 0.0)
    assert request.latest_start == pytest.approx(1.0 - 2 * 0.014 - 0.1)  # two full batches, 10 % reserve
    tight = req(0.0, timeout=0.020)  # only an immediate start makes it: no room for a batch ahead
    make().admit(tight, LIMITS, 0.0)
    assert tight.latest_start == pytest.approx(0.020 - 0.011)


def test_deadline_below_minimum_service_time_is_invalid_argument() -> None:
    error = refused(make(), req(0.0, timeout=0.005))
    assert (
        error.code == Code.INVALID_ARGUMENT and not error.retryable and error.reason == "deadline_too_short"
    )


def test_deadline_infeasible_only_because_of_load_is_unavailable_with_drain_hint() -> None:
    admission = make()
    dispatcher = admission.dispatcher
    for _ in range(4):
        admission.admit(req(0.0, timeout=10.0, priority=1, tenant="gold"), LIMITS, 0.0)
    dispatcher.poll(0.0)  # the worker takes one batch; 3 wait
    for _ in range(3):
        admission.admit(req(0.0, timeout=10.0, priority=1, tenant="gold"), LIMITS, 0.0)
    error = refused(admission, req(0.0, timeout=0.020, priority=1, tenant="gold"))
    assert error.code == Code.UNAVAILABLE and error.reason == "deadline_unmeetable_now"
    assert error.retry_after_s == pytest.approx(0.014 + 0.014, rel=0.01)  # one batch queued + one running


def test_full_lane_evicts_lower_priority_newest_first_and_refuses_equals() -> None:
    admission = make()
    dispatcher = admission.dispatcher
    dispatcher.worker_accepting("w", False)  # nothing drains: the lane fills up
    bronze = [req(0.0, 10.0) for _ in range(4)]
    for request in bronze:
        admission.admit(request, LIMITS, 0.0)
    assert refused(admission, req(0.0, 10.0)).reason == "queue_full"
    evicted = admission.admit(req(0.0, 10.0, tenant="gold", priority=1), LIMITS, 0.0)
    [(victim, error)] = evicted
    assert victim is bronze[-1]
    assert error.code == Code.UNAVAILABLE and error.reason == "shed" and error.retry_after_s
    assert dispatcher.queued() == 4


def test_byte_bound_evicts_across_lanes() -> None:
    settings = AdmissionSettings(estimate_margin=1.0, lane_max_queued=100, max_queued_bytes=1024)
    admission = make(settings)
    admission.dispatcher.worker_accepting("w", False)
    for _ in range(3):
        admission.admit(req(0.0, 10.0, size=300), LIMITS, 0.0)
    assert refused(admission, req(0.0, 10.0, size=300)).reason == "queue_full"
    evicted = admission.admit(req(0.0, 10.0, tenant="gold", priority=1, size=600), LIMITS, 0.0)
    assert len(evicted) == 2 and admission.dispatcher.queued_bytes == 900


def test_queued_request_is_dropped_when_it_can_no_longer_meet_its_deadline() -> None:
    admission = make()
    dispatcher = admission.dispatcher
    dispatcher.workers.reserve("w", 1, 0.0, 0.0)  # the only worker is busy: the lane cannot drain
    request = req(0.0, timeout=0.5)
    admission.admit(request, LIMITS, 0.0)
    decision = dispatcher.poll(0.0)
    assert decision.rejected == [] and decision.wake_at == pytest.approx(request.latest_start)
    decision = dispatcher.poll(request.latest_start)
    [(gone, error)] = decision.rejected
    assert gone is request and error.reason == "deadline_unmeetable"
    assert error.code == Code.UNAVAILABLE and error.retry_after_s  # early, so a retry may still succeed
    assert request.latest_start < request.deadline
    late = req(0.0, timeout=0.5)
    admission.admit(late, LIMITS, 0.0)
    [(_, error)] = dispatcher.poll(late.deadline).rejected
    assert error.code == Code.DEADLINE_EXCEEDED and error.reason == "expired_in_queue"


def test_cancellation_removes_from_queue_and_frees_inflight() -> None:
    admission = make()
    admission.dispatcher.worker_accepting("w", False)
    request = req(0.0, 10.0)
    admission.admit(request, LIMITS, 0.0)
    assert admission.limiter.inflight["bronze"] == 1
    assert admission.dispatcher.cancel(request.request_id) is request
    admission.release(request)
    assert admission.limiter.inflight["bronze"] == 0 and admission.dispatcher.queued() == 0


def test_disabled_admission_is_an_unbounded_fifo() -> None:
    settings = AdmissionSettings(enabled=False, lane_max_queued=1)
    admission = make(settings)
    admission.dispatcher.worker_accepting("w", False)
    for _ in range(50):
        assert admission.admit(req(0.0, 0.001), LIMITS, 0.0) == []
    assert admission.dispatcher.queued() == 50


def test_batcher_cuts_before_the_tightest_budget_runs_out() -> None:
    admission = make()
    dispatcher = admission.dispatcher
    dispatcher.worker_joined("w", {("m", "1")}, capacity=2)
    dispatcher.workers.reserve("w", 1, 0.0, 0.0)  # one slot free, worker not idle: no work-conserving cut
    patient = LaneLimits(max_batch_size=4, max_wait_s=10.0)
    request = req(0.0, timeout=0.100)
    admission.admit(request, patient, 0.0)
    decision = dispatcher.poll(0.0)
    growth = 0.003  # t(4) - t(1): a fuller batch would take this much longer
    assert decision.dispatches == []
    assert decision.wake_at is not None
    assert decision.wake_at == pytest.approx(request.latest_start - growth)
    decision = dispatcher.poll(decision.wake_at)
    assert [d.reason for d in decision.dispatches] == ["deadline"]
