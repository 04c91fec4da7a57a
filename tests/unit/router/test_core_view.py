"""The core's read-only view (router/policy/core_view.py): what the shell asks, answered from the core's
own state, and nothing in it can change the core."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from sluice_inference.router.policy.core_view import WorkerView
from tests.unit.router.core_support import KEY, join, make_core, occupy, request


def test_workers_and_readiness_follow_the_core() -> None:
    core = make_core()
    view = core.view
    assert not view.any_accepting() and view.ready_workers("m") == 0 and view.workers() == ()
    join(core, "w2")
    core.worker_registered(0.0, "w1", {("m", "1"): {}}, 2, False, device="cuda")  # registered, not ready
    assert view.any_accepting() and view.accepting_count() == 1 and view.worker_count() == 2
    assert view.ready_workers("m") == 1 and view.ready_workers("other") == 0
    assert [w.worker_id for w in view.workers()] == ["w1", "w2"]
    assert view.workers()[1] == WorkerView("w2", True, frozenset({("m", "1")}), 0)
    with pytest.raises(FrozenInstanceError):
        view.workers()[0].accepting = True  # type: ignore[misc]


def test_in_flight_lanes_and_queues_are_snapshots() -> None:
    core = make_core()
    view = core.view
    dispatch = occupy(core)
    assert view.in_flight_batches() == 1 and view.in_flight_on(dispatch.worker_id) == 1
    assert view.dispatch(dispatch.batch_id) is dispatch and view.dispatch(dispatch.batch_id + 1) is None
    core.arrive(0.5, request(0.5, timeout=60.0))
    [lane] = view.lanes(1.0)
    assert lane.key == KEY and lane.depth == 1 and lane.oldest_age_s == pytest.approx(0.5)
    assert view.queued() == 1 and view.queued_bytes() == 100
    assert view.queued_by_version(1.0)[("m", "1")].depth == 1
    assert view.shape_state()["lanes_in_flight"] == 1


def test_estimates_breaker_and_quotas() -> None:
    core = make_core()
    join(core, "w")
    view = core.view
    assert view.batch_seconds("m", "1", 4) == pytest.approx(0.014, rel=0.01)
    assert not view.breaker_open("w", 0.0)
    assert view.routers() == 1 and view.inflight("gold") == 0
    levels = view.tenants(0.0)
    assert levels["gold"].share == pytest.approx(1.0)
