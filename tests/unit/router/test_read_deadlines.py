"""One timer for every body being read (router/read_deadlines.py): a read past its deadline has its task
cancelled, at most `MIN_SWEEP_S` late; a read that ended is left alone; no timer waits while none reads."""

from __future__ import annotations

import asyncio
from typing import Any

from sluice_inference.common.clock import FakeClock
from sluice_inference.router.read_deadlines import MIN_SWEEP_S, ReadDeadlines


async def _reader() -> asyncio.Task[Any]:
    """A task that waits for a body that never comes."""
    task = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    return task


async def test_a_read_past_its_deadline_is_cut_and_one_that_ended_is_not() -> None:
    clock = FakeClock(100.0)
    reads = ReadDeadlines(clock)
    slow, quick = await _reader(), await _reader()
    reads.start(slow, 105.0)
    reads.start(quick, 105.0)
    reads.end(quick)
    clock.advance(4.9)
    assert not slow.cancelling() and len(reads) == 1
    clock.advance(0.1)
    assert slow.cancelling() and reads.was_cut(slow) and not reads.was_cut(quick)
    assert not quick.cancelling()
    reads.end(slow)
    assert not reads.was_cut(slow) and len(reads) == 0
    assert clock.next_timer() is None  # nothing reads: nothing waits
    for task in (slow, quick):
        task.cancel()


async def test_an_earlier_deadline_moves_the_timer_and_later_ones_wait_their_turn() -> None:
    clock = FakeClock(0.0)
    reads = ReadDeadlines(clock)
    late, early, next_one = await _reader(), await _reader(), await _reader()
    reads.start(late, 30.0)
    reads.start(early, 2.0)  # came in later with less time (it waited for a receive slot)
    assert clock.next_timer() == 2.0
    reads.start(next_one, 2.0 + MIN_SWEEP_S / 2)
    clock.jump_to(2.0)
    assert early.cancelling() and not next_one.cancelling()
    assert clock.next_timer() == 2.0 + MIN_SWEEP_S  # not sooner: a read is cut at most that late
    clock.jump_to(2.0 + MIN_SWEEP_S)
    assert next_one.cancelling() and not late.cancelling()
    assert clock.next_timer() == 30.0
    for task in (late, early, next_one):
        reads.end(task)
        task.cancel()
