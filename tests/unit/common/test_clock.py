"""The clock's timers (common/clock.py): a FakeClock drives sleeps, timers and bounded waits without any
real time passing, and the monotonic clock maps them onto the event loop."""

from __future__ import annotations

import asyncio
import contextlib

from sluice_inference.common.clock import (
    Alarm,
    FakeClock,
    MonotonicClock,
    cancel_until_done,
    sleep_until,
    wait_until,
)


async def settle() -> None:
    """Let woken tasks run (a few turns of the loop, no real waiting)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def wakes_after(clock: FakeClock, sleeper: asyncio.Task[None], seconds: float) -> None:
    """Assert that `sleeper` sleeps on until the clock has moved `seconds`, and not a moment longer."""
    await settle()
    clock.advance(seconds - 1.0)
    await settle()
    assert not sleeper.done()
    clock.advance(1.0)
    await settle()
    assert sleeper.done()


def test_timers_fire_in_time_order_when_the_clock_passes_them_and_never_once_cancelled() -> None:
    clock = FakeClock(10.0)
    fired: list[str] = []
    clock.call_at(12.0, lambda: fired.append("b"))
    clock.call_at(11.0, lambda: fired.append("a"))
    dropped = clock.call_at(11.5, lambda: fired.append("dropped"))
    clock.call_at(9.0, lambda: fired.append("due"))
    assert fired == []  # never from inside call_at, even when already due
    dropped.cancel()
    assert clock.next_timer() == 9.0
    clock.advance(1.0)
    assert fired == ["due", "a"]
    clock.jump_to(20.0)
    assert fired == ["due", "a", "b"] and clock.next_timer() is None


async def test_a_sleep_ends_only_when_the_fake_clock_is_moved() -> None:
    clock = FakeClock(0.0)
    await wakes_after(clock, asyncio.create_task(clock.sleep(5.0)), 5.0)
    await sleep_until(clock, 1.0)  # already past: returns at once


async def test_a_bounded_wait_ends_on_the_event_or_at_the_clocks_limit() -> None:
    clock = FakeClock(0.0)
    event = asyncio.Event()
    waiting = asyncio.ensure_future(event.wait())
    bounded = asyncio.create_task(wait_until(clock, {waiting}, 2.0))
    await settle()
    assert not bounded.done()
    event.set()
    assert await bounded and waiting.done()
    never = asyncio.ensure_future(asyncio.Event().wait())
    timed_out = asyncio.create_task(wait_until(clock, {never}, 2.0))
    await settle()
    clock.advance(2.0)
    assert not await timed_out and not never.done()  # the waited-on future is left alone
    never.cancel()


async def test_an_alarm_wakes_when_set_or_at_the_clocks_time_and_never_swallows_a_cancel() -> None:
    clock = FakeClock(0.0)
    alarm = Alarm(clock)
    sleeper = asyncio.create_task(alarm.sleep_until(5.0))
    await settle()
    alarm.set()
    await settle()
    assert sleeper.done() and clock.now() == 0.0  # woken by the set, not the clock
    await alarm.sleep_until(5.0)  # set since the last clear: returns at once
    alarm.clear()
    await wakes_after(clock, asyncio.create_task(alarm.sleep_until(5.0)), 5.0)
    assert clock.next_timer() is None  # its timer went with the sleep
    alarm.clear()
    sleeper = asyncio.create_task(alarm.sleep_until(10.0))
    await settle()
    alarm.set()  # woken and cancelled in the same turn: the cancellation wins
    sleeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sleeper
    assert sleeper.cancelled()


async def test_the_monotonic_clock_uses_the_loop_timers_on_its_own_scale() -> None:
    clock = MonotonicClock()
    assert abs(clock.now() - asyncio.get_running_loop().time()) < 0.05
    fired = asyncio.Event()
    clock.call_at(clock.now() + 0.01, fired.set)
    started = clock.now()
    assert await wait_until(clock, {asyncio.ensure_future(fired.wait())}, started + 1.0)
    assert clock.now() - started < 1.0
    await clock.sleep(0.0)


async def test_cancel_until_done_cancels_a_swallowed_cancel_again_and_bounds_a_task_that_never_ends() -> None:
    clock = FakeClock(0.0)
    release = asyncio.Event()

    async def swallows_one() -> None:  # as aetcd's watcher does around an await of its own
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await asyncio.Event().wait()  # a second cancel ends it

    async def never_ends() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    stubborn, hopeless = asyncio.create_task(swallows_one()), asyncio.create_task(never_ends())
    quick = asyncio.create_task(asyncio.Event().wait())
    await settle()
    stopping = asyncio.create_task(cancel_until_done(clock, [stubborn, hopeless, quick], 4.0, 1.5))
    await settle()
    assert quick.cancelled() and not stubborn.done()
    clock.advance(1.5)  # the second round of cancels
    await settle()
    assert stubborn.cancelled() and not stopping.done()
    clock.advance(2.5)
    assert await stopping == {hopeless}  # left behind, not waited for past the bound
    release.set()
    await settle()
    assert hopeless.done()
