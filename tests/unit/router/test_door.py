"""The front door's control law: it admits everything while calls reach the router promptly, shrinks the
admitted fraction while they wait too long, spreads refusals evenly, never refuses everything, and
recovers."""

from __future__ import annotations

from router.policy.door import DECREASE, INCREASE, MIN_FRACTION, Door


def admitted(door: Door, requests: int) -> int:
    return sum(door.admit() for _ in range(requests))


def test_prompt_calls_admit_everything() -> None:
    door = Door(max_delay_s=0.010)
    for _ in range(100):
        door.observe(0.001)
    assert admitted(door, 1000) == 1000 and door.refused == 0


def test_delay_above_the_bound_shrinks_the_admitted_share_multiplicatively_down_to_a_floor() -> None:
    door = Door(max_delay_s=0.010)
    door.observe(0.030)
    assert door.fraction == DECREASE
    for _ in range(200):
        door.observe(0.030)
    assert door.fraction == MIN_FRACTION
    assert admitted(door, 1000) == 10  # never nothing: a trickle keeps estimates and health current


def test_refusals_are_spread_evenly_not_in_runs() -> None:
    door = Door(max_delay_s=0.010, fraction=0.25)
    pattern = [door.admit() for _ in range(40)]
    assert sum(pattern) == 10
    assert all(sum(pattern[i : i + 4]) == 1 for i in range(0, 40, 4))  # one in every four, like clockwork


def test_delay_between_half_and_the_bound_holds_the_share_and_low_delay_recovers_it_additively() -> None:
    door = Door(max_delay_s=0.010, fraction=0.5)
    door.observe(0.007)
    assert door.fraction == 0.5
    door.observe(0.001)
    assert door.fraction == 0.5 + INCREASE
    for _ in range(100):
        door.observe(0.001)
    assert door.fraction == 1.0


def test_a_door_with_no_bound_never_refuses() -> None:
    door = Door(max_delay_s=0.0)
    for _ in range(100):
        door.observe(5.0)
    assert admitted(door, 100) == 100 and door.delay_s == 5.0
