"""Lane ordering: priority with aging, weighted fair share across tenants, EDF, and eviction order."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from sluice_inference.common.records import ModelRecord, TensorSpec
from sluice_inference.router.policy import lanes as lanes_module
from sluice_inference.router.policy.lanes import (
    MAX_REMEMBERED_LIMITS,
    Lane,
    LaneKey,
    LaneLimits,
    QueuedRequest,
)

KEY = LaneKey("m", "1")
_ids = itertools.count(1)


def req(
    tenant: str = "t", priority: int = 1, weight: float = 1.0, arrival: float = 0.0, deadline: float = 100.0
) -> QueuedRequest:
    return QueuedRequest(
        next(_ids), KEY, 1, arrival, deadline, tenant=tenant, priority=priority, weight=weight
    )


def lane(aging_s: float = 1000.0) -> Lane:
    return Lane(KEY, LaneLimits(max_batch_size=8, max_wait_s=0.001), aging_s)


def test_higher_priority_first() -> None:
    q = lane()
    low, high = req(priority=3), req(priority=1)
    q.push(low)
    q.push(high)
    assert q.pop_next(0.0) is high
    assert q.pop_next(0.0) is low


def test_weights_one_to_three_share_a_saturated_lane_one_to_three() -> None:
    q = lane()
    for _ in range(2000):
        q.push(req("light", weight=1))
        q.push(req("heavy", weight=3))
    served = Counter(q.pop_next(0.0).tenant for _ in range(2000))  # type: ignore[union-attr]
    assert served["heavy"] / served["light"] == pytest.approx(3.0, rel=0.10)


def test_idle_tenant_earns_no_credit() -> None:
    q = lane()
    for _ in range(100):
        q.push(req("busy"))
    for _ in range(50):
        q.pop_next(0.0)
    for _ in range(100):
        q.push(req("late"))
    first_ten = Counter(q.pop_next(0.0).tenant for _ in range(10))  # type: ignore[union-attr]
    assert first_ten["late"] <= 6  # alternates with "busy" instead of catching up on 50 turns


def test_earliest_deadline_first_within_a_tenant() -> None:
    q = lane()
    later, sooner = req(deadline=9.0), req(deadline=2.0)
    q.push(later)
    q.push(sooner)
    assert q.pop_next(0.0) is sooner


def test_low_priority_is_served_after_at_most_p_times_aging_under_a_high_priority_flood() -> None:
    aging = 1.0
    q = lane(aging_s=aging)
    starving = req(priority=3, arrival=0.0)
    q.push(starving)
    now = 0.0
    while True:
        q.push(req(priority=1, arrival=now))  # a fresh high-priority request every step
        served = q.pop_next(now)
        if served is starving:
            break
        now += 0.01
        assert now <= 3 * aging + 0.02, "priority 3 starved past its aging bound"
    assert now >= (3 - 1) * aging  # it did wait its turn at first


def test_victim_is_the_newest_request_of_the_heaviest_tenant_at_the_worst_priority() -> None:
    q = lane()
    q.push(req("a", priority=2, arrival=0.0))
    q.push(req("b", priority=3, arrival=1.0))
    heavy_old = req("c", priority=3, arrival=2.0)
    heavy_new = req("c", priority=3, arrival=3.0)
    q.push(heavy_old)
    q.push(heavy_new)
    assert q.victim(newcomer_priority=1) is heavy_new
    assert q.victim(newcomer_priority=3) is None  # equal priority never evicts


def test_pop_batch_respects_rows_and_requeues_the_overflow() -> None:
    q = Lane(KEY, LaneLimits(max_batch_size=4, max_wait_s=0.0))
    big = QueuedRequest(next(_ids), KEY, 3, 0.0, 10.0)
    other = QueuedRequest(next(_ids), KEY, 3, 0.1, 10.0)
    q.push(big)
    q.push(other)
    assert q.pop_batch(0.0) == [big]
    assert len(q) == 1 and q.rows == 3 and q.oldest_arrival() == 0.1


def test_removal_keeps_counts_exact() -> None:
    q = lane()
    gone = req()
    q.push(gone)
    q.push(req())
    assert q.remove(gone.request_id) is gone
    assert q.remove(gone.request_id) is None
    assert len(q) == 1 and q.rows == 1


def test_batch_is_capped_by_cost_as_well_as_rows() -> None:
    q = Lane(KEY, LaneLimits(max_batch_size=32, max_wait_s=0.0, max_batch_cost=256))
    for _ in range(6):
        q.push(QueuedRequest(next(_ids), KEY, 1, 0.0, 10.0, cost=64))
    assert len(q.pop_batch(0.0)) == 4 and len(q) == 2


def _record(max_batch_size: int, max_wait_s: float = 0.002) -> ModelRecord:
    spec = TensorSpec(name="x", datatype="FP32", dims=(4,))
    return ModelRecord(name="m", version="1", digest="d", platform="synthetic", max_batch_size=max_batch_size,
                       max_wait_s=max_wait_s, inputs=(spec,), outputs=(spec,))  # fmt: skip


def test_limits_of_a_record_are_shared_follow_a_changed_record_and_stay_bounded() -> None:
    first = LaneLimits.of(_record(8))
    assert LaneLimits.of(_record(8)) is first  # one object per distinct limits, not one per request
    assert LaneLimits.of(_record(8, max_wait_s=0.005)) == LaneLimits(8, 0.005)
    for size in range(1, MAX_REMEMBERED_LIMITS + 2):
        assert LaneLimits.of(_record(size)) == LaneLimits(size, 0.002)
    assert lanes_module._shared_limits.cache_info().currsize <= MAX_REMEMBERED_LIMITS


def test_batch_limits_are_built_once_per_lane_limits() -> None:
    limits = LaneLimits(8, 0.0, 64, 1000)
    assert limits.batch is limits.batch
    assert (limits.batch.max_rows, limits.batch.max_cost, limits.batch.max_bytes) == (8, 64, 1000)
