"""bench/door_model.py: the real Door behind a modelled queue ends every call once, serves a load under
capacity whole, and past capacity refuses part of the load while still serving most of what the core
can take; with two levels the highest keeps its calls, also when they take long after their turn (which a
door cutting only at its whole bound let go late)."""

from __future__ import annotations

import pytest

from sluice_inference.bench.door_model import Costs, run
from sluice_inference.router.policy import door as door_module
from sluice_inference.router.policy.door import Door

COSTS = Costs()
BOUND = 0.03


def test_under_capacity_every_call_is_admitted_and_in_time() -> None:
    door = Door(BOUND, 1.0)
    outcome = run(0.8 * COSTS.capacity, door, COSTS, duration_s=3.0)
    assert outcome.offered > 0.9 * 0.8 * COSTS.capacity * 3.0
    assert outcome.refused == 0 and outcome.late == 0 and outcome.good == outcome.offered


def test_past_capacity_the_door_refuses_and_every_call_ends_once() -> None:
    door = Door(BOUND, 1.0)
    outcome = run(1.5 * COSTS.capacity, door, COSTS, duration_s=5.0)
    assert outcome.good + outcome.late + outcome.refused == outcome.offered
    assert 0 < outcome.refused <= door.refused  # the door also refused some of the warm-up's calls
    assert min(fraction for _, _, fraction in outcome.samples) < 1.0
    assert outcome.good > 0.3 * COSTS.capacity * 5.0


def test_the_door_off_lets_the_queue_grow_until_nothing_is_in_time() -> None:
    """Without the door, 1.5x capacity builds a queue that makes almost every call late: the model's
    queue is what the door has to manage."""
    outcome = run(1.5 * COSTS.capacity, Door(0.0), COSTS, duration_s=5.0)
    assert outcome.refused == 0 and outcome.samples == []
    assert outcome.good < 0.1 * outcome.offered


def test_with_two_levels_the_highest_keeps_its_calls() -> None:
    door = Door(BOUND, 1.0)
    outcome = run(1.3 * COSTS.capacity, door, COSTS, duration_s=5.0, gold_share=0.25)
    assert outcome.gold_good >= 0.9 * outcome.gold_offered
    assert outcome.good - outcome.gold_good < 0.9 * (outcome.offered - outcome.gold_offered)


def gold_kept(after_s: float) -> float:
    """Gold's share of its calls within the SLO at 1.5x capacity, gold a quarter of the calls."""
    outcome = run(
        1.5 * COSTS.capacity, Door(BOUND, 1.0), Costs(after_s=after_s), duration_s=5.0, gold_share=0.25
    )
    return outcome.gold_good / outcome.gold_offered


def test_the_highest_level_keeps_its_calls_also_when_they_take_long_after_their_turn() -> None:
    """A pressed router holds batches, so an admitted call answers ~20 ms after its turn, not 5."""
    assert gold_kept(0.005) >= 0.95 and gold_kept(0.020) >= 0.95


def test_cutting_only_at_the_whole_bound_lets_the_highest_level_s_slow_calls_go_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The law before `PROTECTED_BOUND` (docs/performance.md, 2026-12-04): the model shows what it cost
    gold on the router, or it could not weigh a law for two levels."""
    monkeypatch.setattr(door_module, "PROTECTED_BOUND", 1.0)
    assert gold_kept(0.005) >= 0.9 and gold_kept(0.020) < 0.85
