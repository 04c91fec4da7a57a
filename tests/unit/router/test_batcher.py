"""TimerBatcher: cut on full, on max wait, on an idle worker; otherwise say when to look again."""

from __future__ import annotations

from router.policy.batcher import Cut, TimerBatcher, WakeAt
from router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest

KEY = LaneKey("mlp", "1", (("input", (256,)),))


def lane_with(arrivals: list[float], rows: int = 1, max_batch: int = 4, max_wait: float = 0.01) -> Lane:
    lane = Lane(KEY, LaneLimits(max_batch_size=max_batch, max_wait_s=max_wait))
    for i, t in enumerate(arrivals):
        lane.push(QueuedRequest(i, KEY, rows, arrival=t, deadline=t + 1.0))
    return lane


def test_cuts_when_full_even_with_busy_worker() -> None:
    assert TimerBatcher().decide(lane_with([0.0] * 4), 0.0, worker_idle=False) == Cut("full")


def test_waits_until_oldest_reaches_max_wait() -> None:
    lane = lane_with([0.0, 0.002])
    assert TimerBatcher().decide(lane, 0.005, worker_idle=False) == WakeAt(0.01)
    assert TimerBatcher().decide(lane, 0.01, worker_idle=False) == Cut("max_wait")


def test_work_conserving_when_worker_idle() -> None:
    assert TimerBatcher().decide(lane_with([0.0]), 0.0, worker_idle=True) == Cut("idle_worker")


def test_full_counts_rows_not_requests() -> None:
    assert TimerBatcher().decide(lane_with([0.0, 0.0], rows=2), 0.0, worker_idle=False) == Cut("full")


def test_pop_batch_never_exceeds_max_rows() -> None:
    lane = lane_with([0.0, 0.0, 0.0], rows=3, max_batch=4)
    first = lane.pop_batch(0.0)
    assert [r.request_id for r in first] == [0]
    assert len(lane) == 2 and lane.rows == 6
