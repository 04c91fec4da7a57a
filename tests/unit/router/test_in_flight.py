"""The in-flight ledger (router/policy/in_flight.py) and the worker-health timers (health.py) return what
is due; they end nothing themselves."""

from __future__ import annotations

from sluice_inference.router.policy.health import WorkerHealth
from sluice_inference.router.policy.in_flight import InFlight
from sluice_inference.router.policy.lanes import LaneKey, QueuedRequest
from sluice_inference.router.policy.outcomes import Dispatch
from sluice_inference.router.policy.workers import WorkerPool

KEY = LaneKey("m", "1")


def _dispatch(batch_id: int, *deadlines: float) -> Dispatch:
    requests = tuple(QueuedRequest(batch_id * 10 + i, KEY, 1, 0.0, d) for i, d in enumerate(deadlines))
    return Dispatch(batch_id, "w", KEY, requests, "full", 0.01, 0.0, len(requests))


def test_overdue_returns_each_batchs_late_requests_and_watches_the_rest() -> None:
    ledger = InFlight()
    first, second = _dispatch(1, 1.0, 3.0), _dispatch(2, 2.0)
    ledger.add(first)
    ledger.add(second)
    assert ledger.overdue(0.5) == [] and ledger.next_overdue() == 1.0
    [(batch, late)] = ledger.overdue(1.0)
    assert batch is first and [r.deadline for r in late] == [1.0]
    late[0].ended = True  # the core ends what is due
    assert ledger.next_overdue() == 2.0  # the first batch is watched again for 3.0
    ledger.forget(second)
    assert ledger.overdue(2.5) == [] and ledger.next_overdue() == 3.0  # a forgotten batch is skipped
    assert ledger.holding(first.requests[1].request_id) is first and ledger.lane_busy(KEY)
    ledger.forget(first)
    assert not ledger.lane_busy(KEY) and len(ledger) == 0 and ledger.overdue(10.0) == []


def test_a_hang_timer_is_superseded_by_progress_and_fires_once() -> None:
    pool, health = WorkerPool(), WorkerHealth(hang_after_s=5.0)
    slot = pool.add("w", [("m", "1")], 2, 2)
    pool.reserve(slot, 1, 1, 0.0, 0.01)
    health.watch(slot)
    assert health.next_hang() == 5.0
    pool.release(slot, 1, 1, 3.0)
    pool.reserve(slot, 2, 1, 3.0, 0.01)
    health.watch(slot)  # progress at 3.0: the timer moves to 8.0
    assert health.hung(6.0) == [] and health.next_hang() == 8.0
    assert health.hung(8.0) == ["w"] and health.hung(100.0) == [] and health.next_hang() is None


def test_a_breaker_reopen_is_returned_when_due() -> None:
    health = WorkerHealth(hang_after_s=5.0)
    for _ in range(10):
        health.failed("w", 0.0)
    reopen = health.next_reopen()
    assert reopen is not None and reopen > 0.0
    assert health.reopened(reopen - 1e-6) == []
    assert "w" in health.reopened(reopen) and not health.breaker.allows("w", 0.0)
