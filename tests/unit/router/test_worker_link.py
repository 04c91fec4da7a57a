"""The worker stream's silence verdict (router/worker_link.py, `SilenceWatch`): a stream is silent after
`STREAM_SILENCE_S` without a message from a busy worker, after an idle worker's announced interval plus
`SILENCE_MARGIN_S`, and `STREAM_SILENCE_S` after a batch sent to an idle worker unless a result or a
busy-pace report comes; a timer the router's own stalled loop ran late gives the messages of that time
one grace to be read."""

from __future__ import annotations

import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.heartbeat import (
    MAX_REPORT_INTERVAL_S,
    SILENCE_MARGIN_S,
    STREAM_SILENCE_S,
    silence_bound_s,
)
from sluice_inference.router.worker_link import STALL_GRACE_S, SilenceWatch

IDLE_MS = 1000
"""An idle worker's announced interval."""


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


def test_the_bound_follows_the_announced_interval_and_is_never_under_the_busy_one() -> None:
    assert silence_bound_s(0) == STREAM_SILENCE_S  # unsaid: a worker that never slows down
    assert silence_bound_s(250) == STREAM_SILENCE_S
    assert silence_bound_s(IDLE_MS) == pytest.approx(1.0 + SILENCE_MARGIN_S)
    assert silence_bound_s(10**9) == pytest.approx(MAX_REPORT_INTERVAL_S + SILENCE_MARGIN_S)


def test_an_idle_worker_is_silent_its_announced_interval_plus_the_margin_after_its_report() -> None:
    clock, silence, verdicts = watch()
    silence.heard(IDLE_MS)
    clock.advance(1.0)
    silence.heard(IDLE_MS)  # reports every second keep it open
    clock.advance(1.0 + SILENCE_MARGIN_S - 0.01)
    assert verdicts == []
    clock.advance(0.01)
    assert verdicts == [pytest.approx(2.0 + SILENCE_MARGIN_S)]


def test_a_batch_sent_to_an_idle_worker_must_be_answered_within_the_busy_bound() -> None:
    clock, silence, verdicts = watch()
    silence.heard(IDLE_MS)
    clock.advance(0.5)
    silence.sent()  # the worker froze right after its report: found 0.8 s after the send, not 1.55 s
    clock.advance(STREAM_SILENCE_S - 0.01)
    assert verdicts == []
    clock.advance(0.01)
    assert verdicts == [pytest.approx(0.5 + STREAM_SILENCE_S)]


def test_a_slow_report_that_crossed_the_batch_does_not_excuse_the_worker() -> None:
    clock, silence, verdicts = watch()
    silence.heard(IDLE_MS)
    clock.advance(0.5)
    silence.sent()
    clock.advance(0.01)
    silence.heard(IDLE_MS)  # written before the batch reached the worker
    clock.jump_to(0.5 + STREAM_SILENCE_S)
    assert verdicts == [pytest.approx(0.5 + STREAM_SILENCE_S)]


@pytest.mark.parametrize("reply", [None, 250], ids=["results", "busy-pace report"])
def test_a_result_or_a_busy_pace_report_after_the_send_answers_it(reply: int | None) -> None:
    clock, silence, verdicts = watch()
    silence.heard(IDLE_MS)
    clock.advance(0.5)
    silence.sent()
    clock.advance(0.2)
    silence.heard(reply)
    clock.advance(STREAM_SILENCE_S - 0.01)  # 0.8 s from that message, not from the send
    assert verdicts == []
    clock.advance(0.01)
    assert verdicts == [pytest.approx(0.7 + STREAM_SILENCE_S)]


def test_sends_to_a_busy_worker_change_nothing() -> None:
    clock, silence, verdicts = watch()
    silence.heard(250)
    clock.advance(0.5)
    silence.sent()
    clock.advance(0.29)
    assert verdicts == []
    clock.advance(0.01)
    assert verdicts == [pytest.approx(STREAM_SILENCE_S)]  # from its last message, as before
