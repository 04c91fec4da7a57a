"""The worker stream's silence verdict (router/worker_link.py, `SilenceWatch`): a stream is silent after
`STREAM_SILENCE_S` without a message, but a timer the router's own stalled loop ran late gives the messages
of that time one grace to be read."""

from __future__ import annotations

from sluice_inference.common.clock import FakeClock
from sluice_inference.router.worker_link import STALL_GRACE_S, STREAM_SILENCE_S, SilenceWatch


def watch() -> tuple[FakeClock, SilenceWatch, list[float]]:
    clock = FakeClock()
    verdicts: list[float] = []
    silence = SilenceWatch(clock, lambda: verdicts.append(clock.now()))
    return clock, silence, verdicts


def test_a_stream_is_silent_exactly_its_bound_after_its_last_message() -> None:
    clock, silence, verdicts = watch()
    silence.heard()
    for _ in range(20):  # reports every 0.25 s keep it open
        clock.advance(0.25)
        silence.heard()
    clock.advance(STREAM_SILENCE_S - 0.01)
    assert verdicts == []
    clock.advance(0.01)
    assert verdicts == [5.0 + STREAM_SILENCE_S]
    clock.advance(10)
    assert len(verdicts) == 1  # once


def test_messages_read_after_the_routers_own_stall_keep_the_stream() -> None:
    clock, silence, verdicts = watch()
    silence.heard()
    clock.jump_to(1.5)  # the loop was held up: the timer due at 0.8 runs 0.7 s late
    assert verdicts == []
    silence.heard()  # the report that waited behind it is read
    clock.advance(STALL_GRACE_S)
    assert verdicts == []
    clock.jump_to(1.5 + STREAM_SILENCE_S)  # on time from here: silent a bound after that report
    assert verdicts == [1.5 + STREAM_SILENCE_S]


def test_a_dead_worker_is_found_one_grace_later_even_when_every_timer_runs_late() -> None:
    clock, silence, verdicts = watch()
    silence.heard()
    clock.jump_to(1.5)
    assert verdicts == []
    clock.jump_to(1.5 + STALL_GRACE_S + 0.5)  # late again: no second grace
    assert verdicts == [1.5 + STALL_GRACE_S + 0.5]


def test_a_dead_worker_found_by_a_late_timer_is_closed_when_the_grace_runs_on_time() -> None:
    clock, silence, verdicts = watch()
    silence.heard()
    clock.jump_to(1.5)
    clock.advance(STALL_GRACE_S)
    assert verdicts == [1.5 + STALL_GRACE_S]


def test_a_stopped_watch_gives_no_verdict_and_an_unstarted_one_none_either() -> None:
    clock, silence, verdicts = watch()
    clock.advance(10)  # no message yet: nothing watched
    silence.heard()
    silence.stop()
    clock.advance(10)
    silence.heard()
    clock.advance(10)
    assert verdicts == []
