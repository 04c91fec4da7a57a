"""The front door's control law: it admits everything while calls reach the router promptly, and also
through a burst shorter than the sustain time; once the wait has stayed above the bound that long it
shrinks the admitted fraction at most once per measured delay, spreads refusals evenly, never refuses
everything, recovers additively until it admits everything again, and closes again once the wait has
stayed above the bound for a tenth of a second if it comes back soon after (a single late sample is
served then); and it hands what it admits out by priority level,
highest first, so a gold tenant keeps its requests while bronze absorbs the refusals."""

from __future__ import annotations

import pytest

from sluice_inference.router.policy.door import (
    DECREASE,
    HOLD_MAX_S,
    INCREASE,
    MIN_FRACTION,
    PROTECTED_BOUND,
    REARM_S,
    REARM_SUSTAIN_S,
    Door,
)

BOUND, SUSTAIN = 0.020, 1.0
GOLD, SILVER, BRONZE = 1, 2, 3
HOLD = 0.015
"""A delay between half the bound and the bound: with one level calling the door's fraction neither
shrinks nor grows."""
HOLD_PROTECTED = PROTECTED_BOUND * HOLD
"""The same between a quarter of the bound and half of it, where a level is protected."""


def admitted(door: Door, requests: int, level: int = GOLD) -> int:
    return sum(door.admit(level) for _ in range(requests))


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


def test_a_wait_that_reaches_the_bound_counts_as_past_it() -> None:
    """The queue probe reports a probe still out at its first mark as exactly the bound (queue_probe.py
    `_watch`): such samples, between waits of twice the bound, must not restart the sustain time."""
    door = Door(BOUND, SUSTAIN)
    for step in range(round(SUSTAIN / 0.05) + 1):
        door.observe(BOUND if step % 2 else 2 * BOUND, step * 0.05)
    assert door.engaged and door.fraction < 1.0


def test_a_sustained_wait_closes_the_door_multiplicatively_down_to_a_floor() -> None:
    door = Door(BOUND, SUSTAIN)
    late_for(door, SUSTAIN)
    assert door.engaged and door.fraction == DECREASE
    late_for(door, 20.0)
    assert door.fraction == MIN_FRACTION
    assert admitted(door, 1000) == 10  # never nothing: a trickle keeps estimates and health current


def test_refusals_are_spread_evenly_not_in_runs() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.25, engaged=True)
    pattern = [door.admit(GOLD) for _ in range(40)]
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


def test_soon_after_opening_a_wait_that_lasts_closes_the_door_quickly_later_the_sustain_applies_again() -> (
    None
):
    door = Door(BOUND, SUSTAIN, fraction=1.0 - INCREASE, engaged=True)
    door.observe(0.001, 0.0)
    assert door.fraction == 1.0 and not door.engaged
    door.observe(0.100, 1.0)  # one late call near capacity: served, not a reason to close
    door.observe(0.001, 1.05)
    assert not door.engaged and admitted(door, 50) == 50
    late = REARM_S - 0.5
    door.observe(0.100, late)
    door.observe(0.100, late + REARM_SUSTAIN_S / 2)
    assert not door.engaged
    door.observe(0.100, late + REARM_SUSTAIN_S + 0.01)  # the wait has lasted: a standing queue, not a burst
    assert door.engaged and door.fraction == DECREASE
    for step in range(10):
        door.observe(0.001, REARM_S + 0.05 * (step + 1))
    assert not door.engaged
    opened = REARM_S + 0.5
    late_for_from = opened + REARM_S + 0.1
    for step in range(5):  # the re-arm has lapsed: a burst shorter than the sustain is served again
        door.observe(0.100, late_for_from + step * REARM_SUSTAIN_S)
    assert not door.engaged and admitted(door, 50) == 50


def test_soon_after_opening_waits_just_over_the_bound_close_it_once_they_last_a_tenth_of_a_second() -> None:
    """A load just past the router's capacity builds its queue slowly: waiting for twice the bound before
    closing again let that queue pass the SLO before every close (docs/performance.md, 2026-12-04)."""
    door = Door(BOUND, SUSTAIN, fraction=1.0 - INCREASE, engaged=True)
    door.observe(0.001, 0.0)
    assert not door.engaged
    just_over = BOUND * 1.1
    door.observe(just_over, 1.0)  # one late sample comes and goes: served
    door.observe(0.001, 1.05)
    assert not door.engaged and admitted(door, 50) == 50
    door.observe(just_over, 2.0)
    door.observe(just_over, 2.0 + REARM_SUSTAIN_S / 2)
    assert not door.engaged
    door.observe(just_over, 2.0 + REARM_SUSTAIN_S)
    assert door.engaged and door.fraction == DECREASE


def test_a_door_with_no_bound_never_refuses() -> None:
    door = Door(0.0, SUSTAIN)
    late_for(door, 10.0, delay=5.0)
    assert admitted(door, 100) == 100 and door.delay_s == 5.0


def offered(
    door: Door, samples: int, per_sample: dict[int, int], delay: float = HOLD_PROTECTED, start: float = 100.0
) -> dict[int, int]:
    """`samples` sample intervals of 50 ms, each with `per_sample[level]` arrivals per level (interleaved)
    and then one delay sample; admitted requests per level over the last half of them."""
    counted = dict.fromkeys(per_sample, 0)
    for step in range(samples):
        pending = dict(per_sample)
        while any(pending.values()):
            for level in per_sample:
                if pending[level]:
                    pending[level] -= 1
                    admitted_now = door.admit(level)
                    counted[level] += admitted_now if step >= samples // 2 else 0
        door.observe(delay, start + step * 0.05)
    return counted


def test_under_overload_gold_keeps_its_share_and_bronze_absorbs_the_refusals() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.5, engaged=True)  # the router takes half of what is offered
    got = offered(door, 40, {GOLD: 25, BRONZE: 75})  # gold is a quarter of it
    assert got[GOLD] == 20 * 25  # every gold request
    assert abs(got[BRONZE] - 20 * 25) <= 20  # bronze gets the rest of the half: a third of its own
    assert door.admitted(GOLD) == 1.0 and abs(door.admitted(BRONZE) - 1 / 3) < 0.02


def test_levels_are_served_highest_first_and_each_keeps_a_trickle() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.3, engaged=True)
    offered(door, 40, {GOLD: 20, SILVER: 20, BRONZE: 60})
    assert door.admitted(GOLD) == 1.0
    assert abs(door.admitted(SILVER) - 0.5) < 0.02  # what is left of 0.3 after gold's 0.2
    assert door.admitted(BRONZE) == MIN_FRACTION


def test_when_gold_alone_is_more_than_the_router_takes_gold_is_refused_too() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.2, engaged=True)
    got = offered(door, 4, {GOLD: 50, BRONZE: 50}, delay=3 * BOUND)  # past twice the bound: gold is too much
    assert 0.1 < door.admitted(GOLD) < 1.0 and door.admitted(BRONZE) == MIN_FRACTION
    assert got[GOLD] > 10 * got[BRONZE]


def test_while_the_wait_is_under_twice_the_bound_gold_is_admitted_whole_whatever_its_burst() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.2, engaged=True)
    offered(door, 20, {GOLD: 20, BRONZE: 80})  # gold is the router's whole fraction
    got = offered(door, 2, {GOLD: 40, BRONZE: 80}, start=110.0)  # and then a Poisson burst doubles it
    assert got[GOLD] == 40 and door.admitted(GOLD) == 1.0 and door.admitted(BRONZE) == MIN_FRACTION


def test_a_fully_open_door_admits_every_level_and_shares_follow_a_change_of_mix() -> None:
    door = Door(BOUND, SUSTAIN)
    assert offered(door, 10, {GOLD: 10, BRONZE: 90}, delay=0.001) == {GOLD: 50, BRONZE: 450}
    door.fraction, door.engaged = 0.5, True
    offered(
        door, 40, {GOLD: 90, BRONZE: 10}, start=110.0
    )  # the mix turned around: now gold alone is more than half, the wait under the bound
    assert door.admitted(BRONZE) == MIN_FRACTION and door.admitted(GOLD) == 1.0


def test_a_level_never_seen_gets_the_tenant_blind_fraction_until_its_volume_is_known() -> None:
    door = Door(BOUND, SUSTAIN, fraction=0.25, engaged=True)
    offered(door, 20, {GOLD: 10}, delay=HOLD)
    assert door.admitted(BRONZE) == 1.0  # not seen: reported open, admitted at the door's fraction
    assert admitted(door, 40, BRONZE) == 10


def test_a_wait_under_twice_the_bound_cuts_the_lower_levels_but_not_gold_s_share() -> None:
    door = Door(BOUND, SUSTAIN, engaged=True)
    offered(door, 60, {GOLD: 25, BRONZE: 75}, delay=1.5 * BOUND)  # a queue draining, or a short stall
    assert door.fraction == pytest.approx(0.25, abs=0.01)
    assert door.admitted(GOLD) == pytest.approx(1.0, abs=0.02) and door.admitted(BRONZE) == MIN_FRACTION
    offered(door, 20, {GOLD: 25, BRONZE: 75}, delay=3 * BOUND, start=110.0)  # gold alone is too much
    assert door.admitted(GOLD) < 0.5 and door.admitted(BRONZE) == MIN_FRACTION


def test_a_lower_level_s_burst_gets_no_sustain_time_while_a_higher_level_calls() -> None:
    door = Door(BOUND, SUSTAIN)
    offered(door, 4, {GOLD: 10, BRONZE: 10}, delay=0.001)
    offered(door, 1, {GOLD: 10, BRONZE: 90}, delay=1.5 * BOUND, start=110.0)  # bronze's burst makes it wait
    assert door.engaged and door.admitted(GOLD) == 1.0 and door.admitted(BRONZE) < 1.0


def test_with_a_single_level_calling_nothing_is_protected() -> None:
    door = Door(BOUND, SUSTAIN, engaged=True)
    offered(door, 60, {GOLD: 100}, delay=1.5 * BOUND)
    assert door.fraction == MIN_FRACTION and door.admitted(GOLD) == MIN_FRACTION


def test_while_a_level_is_protected_a_wait_past_half_the_bound_cuts_the_lower_levels() -> None:
    """A protected call also waits for its batch and forward after the door: the wait that cuts is half
    the bound then (docs/performance.md, 2026-12-04 evening); with one level the same wait holds."""
    two = Door(BOUND, SUSTAIN, fraction=0.5, engaged=True)
    offered(two, 40, {GOLD: 25, BRONZE: 75}, delay=HOLD)
    assert two.fraction == pytest.approx(0.25, abs=0.01)
    assert two.admitted(GOLD) == pytest.approx(1.0, abs=0.02) and two.admitted(BRONZE) == MIN_FRACTION
    one = Door(BOUND, SUSTAIN, fraction=0.5, engaged=True)
    offered(one, 40, {BRONZE: 100}, delay=HOLD)
    assert one.fraction == 0.5
    offered(two, 10, {GOLD: 25, BRONZE: 75}, delay=BOUND / 5, start=110.0)
    assert two.fraction > 0.4  # under a quarter of the bound it regains
