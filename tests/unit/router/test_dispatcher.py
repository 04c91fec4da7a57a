"""The dispatcher under a fake clock: batches, slots, least-loaded choice, expiry, cancellation, loss."""

from __future__ import annotations

import itertools

import pytest

from common.clock import FakeClock
from common.errors import Code
from router.policy.batcher import BatchContext, Cut, TimerBatcher, WakeAt
from router.policy.dispatcher import Dispatcher
from router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest
from router.policy.scheduler import LeastLoaded

KEY = LaneKey("mlp", "1", (("input", (256,)),))
LIMITS = LaneLimits(max_batch_size=8, max_wait_s=0.010)
_ids = itertools.count(1)


def request(clock: FakeClock, *, timeout: float = 1.0, rows: int = 1, lane: LaneKey = KEY) -> QueuedRequest:
    now = clock.now()
    return QueuedRequest(next(_ids), lane, rows, arrival=now, deadline=now + timeout)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


@pytest.fixture
def dispatcher() -> Dispatcher:
    d = Dispatcher(batcher=TimerBatcher(), chooser=LeastLoaded())  # the timer batcher's contract (issue 2)
    for name in ("w1", "w2"):
        d.worker_joined(name, {("mlp", "1")}, capacity=2)
    return d


def fill_slots(dispatcher: Dispatcher, clock: FakeClock) -> None:
    """Occupy every worker slot with a one-request batch, leaving the queue empty."""
    while any(w.has_free_slot for w in dispatcher.workers):
        dispatcher.submit(request(clock), LIMITS)
        clock.advance(LIMITS.max_wait_s)
        assert len(dispatcher.poll(clock.now()).dispatches) == 1
    assert dispatcher.queued() == 0


def test_idle_workers_get_work_immediately(dispatcher: Dispatcher, clock: FakeClock) -> None:
    dispatcher.submit(request(clock), LIMITS)
    decision = dispatcher.poll(clock.now())
    assert len(decision.dispatches) == 1 and decision.dispatches[0].reason == "idle_worker"


def test_busy_workers_accumulate_until_max_wait(dispatcher: Dispatcher, clock: FakeClock) -> None:
    for _ in range(2):  # occupy one slot on each worker
        dispatcher.submit(request(clock), LIMITS)
        dispatcher.poll(clock.now())
    for _ in range(3):
        dispatcher.submit(request(clock), LIMITS)
    decision = dispatcher.poll(clock.now())
    assert decision.dispatches == []
    assert decision.wake_at == pytest.approx(clock.now() + LIMITS.max_wait_s)
    assert decision.wake_at is not None
    clock.jump_to(decision.wake_at)
    decision = dispatcher.poll(clock.now())
    assert [d.rows for d in decision.dispatches] == [3]
    assert decision.dispatches[0].reason == "max_wait"


def test_full_batch_leaves_without_waiting(dispatcher: Dispatcher, clock: FakeClock) -> None:
    for _ in range(2):
        dispatcher.submit(request(clock), LIMITS)
        dispatcher.poll(clock.now())
    for _ in range(LIMITS.max_batch_size + 3):
        dispatcher.submit(request(clock), LIMITS)
    decision = dispatcher.poll(clock.now())
    assert [(d.rows, d.reason) for d in decision.dispatches] == [(8, "full")]


def test_at_most_capacity_batches_per_worker(dispatcher: Dispatcher, clock: FakeClock) -> None:
    for _ in range(40):
        dispatcher.submit(request(clock), LIMITS)
        dispatcher.poll(clock.now())
    clock.advance(1.0 - 1e-6)
    dispatcher.poll(clock.now())
    per_worker = {w.worker_id: w.in_flight_batches for w in dispatcher.workers}
    assert per_worker == {"w1": 2, "w2": 2}
    assert dispatcher.queued() > 0


def test_least_loaded_worker_is_chosen(dispatcher: Dispatcher, clock: FakeClock) -> None:
    dispatcher.submit(request(clock), LIMITS)
    first = dispatcher.poll(clock.now()).dispatches[0]
    dispatcher.submit(request(clock), LIMITS)
    second = dispatcher.poll(clock.now()).dispatches[0]
    assert {first.worker_id, second.worker_id} == {"w1", "w2"}
    dispatcher.complete(first.batch_id, clock.now())
    dispatcher.submit(request(clock), LIMITS)
    third = dispatcher.poll(clock.now()).dispatches[0]
    assert third.worker_id == first.worker_id


def test_expired_requests_are_never_dispatched(dispatcher: Dispatcher, clock: FakeClock) -> None:
    fill_slots(dispatcher, clock)
    late = request(clock, timeout=0.005)
    dispatcher.submit(late, LIMITS)
    decision = dispatcher.poll(clock.now())
    assert decision.wake_at == pytest.approx(late.deadline)
    clock.jump_to(late.deadline)
    for batch_id in list(dispatcher.in_flight):
        dispatcher.complete(batch_id, clock.now())
    decision = dispatcher.poll(clock.now())
    assert decision.dispatches == []
    assert [(r.request_id, e.code) for r, e in decision.rejected] == [
        (late.request_id, Code.DEADLINE_EXCEEDED)
    ]


def test_cancelled_request_leaves_the_queue(dispatcher: Dispatcher, clock: FakeClock) -> None:
    fill_slots(dispatcher, clock)
    gone = request(clock)
    dispatcher.submit(gone, LIMITS)
    assert dispatcher.cancel(gone.request_id) is gone
    assert dispatcher.cancel(gone.request_id) is None
    assert dispatcher.queued() == 0


def test_lanes_never_mix_shapes(dispatcher: Dispatcher, clock: FakeClock) -> None:
    other = LaneKey("mlp", "1", (("input", (128,)),))
    for _ in range(2):
        dispatcher.submit(request(clock), LIMITS)
        dispatcher.poll(clock.now())
    dispatcher.submit(request(clock), LIMITS)
    dispatcher.submit(request(clock, lane=other), LIMITS)
    clock.advance(LIMITS.max_wait_s)
    batches = dispatcher.poll(clock.now()).dispatches
    assert sorted(d.lane.shape[0][1][0] for d in batches) == [128, 256]
    assert all(len(d.requests) == 1 for d in batches)


def test_model_without_workers_is_rejected_retryably(clock: FakeClock) -> None:
    dispatcher = Dispatcher()
    dispatcher.submit(request(clock), LIMITS)
    decision = dispatcher.poll(clock.now())
    [(_, error)] = decision.rejected
    assert error.code == Code.UNAVAILABLE and error.retryable and error.retry_after_s


def test_draining_worker_gets_no_new_batches(dispatcher: Dispatcher, clock: FakeClock) -> None:
    dispatcher.worker_accepting("w1", False)
    for _ in range(3):
        dispatcher.submit(request(clock), LIMITS)
        clock.advance(LIMITS.max_wait_s)
        dispatcher.poll(clock.now())
    assert {d.worker_id for d in dispatcher.in_flight.values()} == {"w2"}


def test_lost_worker_hands_back_its_batches(dispatcher: Dispatcher, clock: FakeClock) -> None:
    dispatcher.submit(request(clock), LIMITS)
    sent = dispatcher.poll(clock.now()).dispatches[0]
    lost = dispatcher.worker_left(sent.worker_id)
    assert lost == [sent]
    assert dispatcher.complete(sent.batch_id, clock.now()) is None


def test_a_worker_with_an_open_breaker_gets_no_batches(dispatcher: Dispatcher, clock: FakeClock) -> None:
    for _ in range(3):
        dispatcher.breaker.failure("w1", clock.now())
    for _ in range(4):
        dispatcher.submit(request(clock), LIMITS)
        clock.advance(LIMITS.max_wait_s)
        for sent in dispatcher.poll(clock.now()).dispatches:
            assert sent.worker_id == "w2"
            dispatcher.complete(sent.batch_id, clock.now())


# ---------------------------------------------------------------- after dispatch: deadlines and hung workers


def test_a_dispatched_request_ends_at_its_deadline_even_if_its_worker_never_answers(
    dispatcher: Dispatcher, clock: FakeClock
) -> None:
    early, later = request(clock, timeout=0.05), request(clock, timeout=0.2)
    dispatcher.submit(early, LIMITS)
    dispatcher.submit(later, LIMITS)
    sent = dispatcher.poll(clock.now()).dispatches
    assert sum(len(d.requests) for d in sent) == 2
    decision = dispatcher.poll(clock.now())
    assert decision.overdue == [] and decision.wake_at == pytest.approx(early.deadline)
    clock.jump_to(early.deadline)
    decision = dispatcher.poll(clock.now())
    assert [(r.request_id, w) for r, w in decision.overdue] == [(early.request_id, sent[0].worker_id)]
    assert decision.wake_at == pytest.approx(later.deadline)
    assert dispatcher.poll(clock.now()).overdue == []  # each request is reported once
    clock.jump_to(later.deadline)
    assert [r.request_id for r, _ in dispatcher.poll(clock.now()).overdue] == [later.request_id]


def test_an_answered_batch_is_never_reported_overdue(dispatcher: Dispatcher, clock: FakeClock) -> None:
    sent_request = request(clock, timeout=0.05)
    dispatcher.submit(sent_request, LIMITS)
    sent = dispatcher.poll(clock.now()).dispatches[0]
    dispatcher.complete(sent.batch_id, clock.now())
    clock.jump_to(sent_request.deadline + 1)
    decision = dispatcher.poll(clock.now())
    assert decision.overdue == [] and decision.wake_at is None


def test_a_worker_that_holds_work_and_answers_nothing_is_reported_hung(clock: FakeClock) -> None:
    dispatcher = Dispatcher(batcher=TimerBatcher(), chooser=LeastLoaded(), hang_after_s=5.0)
    dispatcher.worker_joined("w1", {("mlp", "1")}, capacity=2)
    dispatcher.submit(request(clock, timeout=60), LIMITS)
    sent = dispatcher.poll(clock.now()).dispatches[0]
    clock.advance(4.9)
    assert dispatcher.poll(clock.now()).hung == []
    clock.advance(0.1)
    assert dispatcher.poll(clock.now()).hung == ["w1"]
    dispatcher.complete(sent.batch_id, clock.now())  # progress (or loss) clears it
    clock.advance(60)
    assert dispatcher.poll(clock.now()).hung == []


def test_an_idle_worker_is_never_hung(dispatcher: Dispatcher, clock: FakeClock) -> None:
    clock.advance(3600)
    assert dispatcher.poll(clock.now()).hung == []


class _BrokenBatcher(TimerBatcher):
    def decide(self, lane: Lane, ctx: BatchContext) -> Cut | WakeAt:
        if lane.key.model == "broken":
            raise ZeroDivisionError("a bug in one lane's decision")
        return super().decide(lane, ctx)


def test_a_bug_in_one_lane_fails_that_lane_only(clock: FakeClock) -> None:
    dispatcher = Dispatcher(batcher=_BrokenBatcher(), chooser=LeastLoaded())
    dispatcher.worker_joined("w1", {("mlp", "1"), ("broken", "1")}, capacity=2)
    broken = request(clock, lane=LaneKey("broken", "1"))
    fine = request(clock)
    dispatcher.submit(broken, LIMITS)
    dispatcher.submit(fine, LIMITS)
    decision = dispatcher.poll(clock.now())
    assert [(r.request_id, e.code) for r, e in decision.rejected] == [(broken.request_id, Code.INTERNAL)]
    assert [r.request_id for d in decision.dispatches for r in d.requests] == [fine.request_id]
    assert dispatcher.queued() == 0


def test_batches_are_cut_to_fit_the_worker_message_limit(dispatcher: Dispatcher, clock: FakeClock) -> None:
    limits = LaneLimits(max_batch_size=8, max_wait_s=0.010, max_batch_bytes=10_000)
    fill_slots(dispatcher, clock)
    for _ in range(6):
        big = request(clock)
        big.wire_bytes = 4_000
        dispatcher.submit(big, limits)
    for batch_id in list(dispatcher.in_flight):
        dispatcher.complete(batch_id, clock.now())
    clock.advance(limits.max_wait_s)
    sizes = [len(d.requests) for d in dispatcher.poll(clock.now()).dispatches]
    assert sizes == [2, 2, 2]  # 6 requests of 4,000 bytes under a 10,000-byte cap: 2 per batch
