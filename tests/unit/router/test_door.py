"""The front door's control law: it admits everything while calls reach the router promptly, and also
through a burst shorter than the sustain time; once the wait has stayed above the bound that long it
shrinks the admitted fraction at most once per measured delay, spreads refusals evenly, never refuses
everything, recovers additively until it admits everything again, and closes again at once if the wait
comes back soon after."""

from __future__ import annotations

from sluice_inference.router.policy.door import DECREASE, HOLD_MAX_S, INCREASE, MIN_FRACTION, REARM_S, Door

BOUND, SUSTAIN = 0.020, 1.0


def admitted(door: Door, requests: int) -> int:
    return sum(door.admit() for _ in range(requests))


def late_for(door: Door, seconds: float, delay: float = 0.100, every: float = 0.05) -> None:
    """Samples above the bound every `every` seconds for `seconds`, starting at t = 0."""
    for step in range(round(seconds / every) + 1):
        door.observe(delay, step * every)


def test_prompt_calls_admit_everything() -> None:
    door = Door(BOUND, SUSTAIN)
    for step in range(100):
        door.observe(0.001, step * 0.05)
    assert admitted(door, 1000) == 1000 and door.refused == 0


def test_a_burst_shorter_than_the_sustain_time_is_served_not_refused() -> None:
    door = Door(BOUND, SUSTAIN)
    late_for(door, 0.9)
    door.observe(0.001, 0.95)  # drained
    late_for(door, 0.9)  # and again: the clock restarts after a prompt sample
    assert not door.engaged and admitted(door, 100) == 100


def test_a_sustained_wait_closes_the_door_multiplicatively_down_to_a_floor() -> None:
    door = Door(BOUND, SUSTAIN)
    late_for(door, SUSTAIN)
    assert door.engaged and door.fraction == DECREASE
    late_for(door, 20.0)
    assert door.fraction == MIN_FRACTION
    assert admitted(door, 1000) == 10  # never nothing: a trickle keeps estimates and health current


def test_refusals_are_spread_evenly_not_in_runs() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.25, engaged=True)
    pattern = [door.admit() for _ in range(40)]
    assert sum(pattern) == 10
    assert all(sum(pattern[i : i + 4]) == 1 for i in range(0, 40, 4))  # one in every four, like clockwork


def test_once_closing_it_cuts_once_per_delay_holds_in_between_and_recovers_to_fully_open() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.5, engaged=True)
    door.observe(0.030, 10.0)
    assert door.fraction == 0.5 * DECREASE  # no new sustain wait while engaged
    door.observe(0.030, 10.02)  # a call queued before the cut: still late, no second cut
    assert door.fraction == 0.5 * DECREASE
    door.observe(0.030, 10.031)  # one delay later the cut has had time to show: cut again
    assert door.fraction == 0.5 * DECREASE**2
    door.observe(0.015, 10.1)  # between half the bound and the bound: hold
    assert door.fraction == 0.5 * DECREASE**2
    door.observe(0.001, 10.2)
    assert door.fraction == 0.5 * DECREASE**2 + INCREASE
    for step in range(100):
        door.observe(0.001, 10.3 + step * 0.05)
    assert door.fraction == 1.0 and not door.engaged


def test_a_delay_of_seconds_still_lets_the_door_cut_every_hold_max() -> None:
    door = Door(BOUND, SUSTAIN, engaged=True)
    for step in range(21):  # one second of samples that each report a two-second wait
        door.observe(2.0, step * 0.05)
    cuts = round(1.0 / HOLD_MAX_S)  # not one cut per two seconds: one per HOLD_MAX_S, give or take one
    assert DECREASE ** (cuts + 1) <= door.fraction <= DECREASE**cuts


def test_soon_after_opening_a_late_sample_closes_the_door_at_once_later_the_sustain_applies_again() -> None:
    door = Door(BOUND, SUSTAIN, fraction=1.0 - INCREASE, engaged=True)
    door.observe(0.001, 0.0)
    assert door.fraction == 1.0 and not door.engaged
    door.observe(0.100, REARM_S - 0.1)
    assert door.engaged and door.fraction == DECREASE
    door.observe(0.001, REARM_S)
    for step in range(10):
        door.observe(0.001, REARM_S + 0.05 * (step + 1))
    assert not door.engaged
    opened = REARM_S + 0.5
    late_for_from = opened + REARM_S + 0.1
    door.observe(0.100, late_for_from)  # the re-arm has lapsed: a burst is served again
    assert not door.engaged and admitted(door, 50) == 50


def test_a_door_with_no_bound_never_refuses() -> None:
    door = Door(0.0, SUSTAIN)
    late_for(door, 10.0, delay=5.0)
    assert admitted(door, 100) == 100 and door.delay_s == 5.0
