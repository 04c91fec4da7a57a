"""Time as an injected object, so policy code is deterministic under test and in the simulator, and the
shells' timers and sleeps can be driven by a fake clock.

Every `now` in router/ and worker/ is a float of seconds on a monotonic scale owned by a Clock: the policy
core (router/policy/) is given it as a parameter and never reads time itself; the async shells read it
from their clock. Deadlines are absolute times on that scale, set once at admission. Every timer and sleep
of the shells goes through the same clock: `call_at` (a callback at an absolute time), `sleep`, and the
helpers built on `call_at` below (`Alarm`, `sleep_until`, `wait_until`). Production uses
`MonotonicClock`, whose timers are the running event loop's (asyncio's loop time is `time.monotonic()`,
the same scale); tests and the simulator use `FakeClock`, which moves only when told to and fires the
timers it passes.

What is rightly not a Clock: `time.time()` for wall-clock records (log lines, records other processes
read, certificates), `time.perf_counter()`/`time.process_time()` for measuring how long something took
(a duration, never compared with a deadline), the synthetic backend's `time.sleep` that stands in for a
device's execution on its own thread, and the timeouts handed to a library's own call (a gRPC call's
`timeout=`, a socket's): those are durations the library enforces on its own clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol


class Timer(Protocol):
    """A scheduled callback that can still be called off."""

    def cancel(self) -> None:
        """Call the callback off (no-op once it ran)."""
        ...


class Clock(Protocol):
    """A source of monotonic time in seconds, and the timers on that scale."""

    def now(self) -> float:
        """Current time in seconds; only differences are meaningful."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` (on the event loop) once the clock reaches `when`."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once `seconds` have passed on this clock."""
        ...


class MonotonicClock:
    """The process's monotonic clock (what production uses); its timers are the running loop's."""

    def now(self) -> float:
        """`time.monotonic()`."""
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """The running loop's `call_at`: its time is `time.monotonic()`, this clock's scale."""
        return asyncio.get_running_loop().call_at(when, callback)

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep`."""
        await asyncio.sleep(seconds)


class _FakeTimer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class FakeClock:
    """A clock that stands still until `advance` or `jump_to` moves it; moving it runs, in time order, every
    timer it passes (so a sleeping task wakes on its next turn of the loop)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._order = itertools.count()

    def now(self) -> float:
        """The current virtual time."""
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` when the clock is next moved (`advance`, `jump_to`) to `when` or past it; never
        from inside this call, as the loop's `call_at` never runs a callback before it returns."""
        timer = _FakeTimer(callback)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        """Return once the clock has been moved `seconds` on."""
        await sleep_until(self, self._now + seconds)

    def next_timer(self) -> float | None:
        """When the soonest pending timer is due (None: none), so a test can jump straight to it."""
        while self._timers and self._timers[0][2].callback is None:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def advance(self, seconds: float) -> None:
        """Move forward by `seconds` (never backwards)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._now += seconds
        self._fire()

    def jump_to(self, when: float) -> None:
        """Move forward to absolute time `when` (no-op if already past it)."""
        self._now = max(self._now, when)
        self._fire()

    def _fire(self) -> None:
        while self._timers and self._timers[0][0] <= self._now:
            _, _, timer = heapq.heappop(self._timers)
            callback, timer.callback = timer.callback, None
            if callback is not None:
                callback()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Alarm:
    """A sleep that an event can cut short (the router's decision loop and its status pass sleep on one):
    `sleep_until(when)` returns when `set()` was called since the last `clear()`, or once the clock
    reaches `when`. Unlike `asyncio.wait_for(event.wait(), timeout)` on Python
    3.11 it never swallows a cancellation that arrives just as it is woken (which once left a router's stop
    waiting forever), and it costs one future per sleep instead of a task."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        """Wake the sleeper now, or make its next sleep return at once."""
        self._set = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def clear(self) -> None:
        """Forget earlier `set` calls."""
        self._set = False

    async def sleep_until(self, when: float) -> None:
        """Until set, or the clock reaches `when`."""
        if self._set:
            return
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        alarm = self._clock.call_at(when, self.set)
        try:
            await waiter
        finally:
            alarm.cancel()
            self._waiter = None


async def sleep_until(clock: Clock, when: float) -> None:
    """Return once `clock` reaches `when` (at once if it has)."""
    if clock.now() >= when:
        return
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    timer = clock.call_at(when, lambda: _resolve(woken))
    try:
        await woken
    finally:
        timer.cancel()


async def wait_until(clock: Clock, waiting: Collection[asyncio.Future[Any]], when: float) -> bool:
    """Wait until one of `waiting` is done or `clock` reaches `when`; whether one is done. Like
    `asyncio.wait(..., return_when=FIRST_COMPLETED)`, it neither cancels `waiting` nor raises their
    outcome, and a cancellation of the caller is never swallowed."""
    if any(f.done() for f in waiting):
        return True
    if clock.now() >= when:
        return False
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()
    timer = clock.call_at(when, lambda: _resolve(woken))
    try:
        await asyncio.wait({*waiting, woken}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        woken.cancel()
    return any(f.done() for f in waiting)


async def cancel_until_done(
    clock: Clock, tasks: Collection[asyncio.Task[Any]], within_s: float, recancel_s: float
) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait until each has ended, cancelling again every `recancel_s` those that have
    not, for at most `within_s`; return those still running then, left behind (their outcome is read when
    they end, so nothing is logged as never retrieved).

    A cancel can be swallowed: aetcd's watcher catches `CancelledError` around an await of its own
    (`Watcher._terminate_stream`), so a watch task cancelled right there goes on, and a router's stop once
    waited past its 5 s step for one. `recancel_s` should exceed what the tasks do when cancelled (a second
    cancel cuts that short). Never raises the tasks' outcome; a cancellation of the caller is not
    swallowed."""
    deadline = clock.now() + within_s
    pending = {task for task in tasks if not task.done()}
    while pending and clock.now() < deadline:
        for task in pending:
            task.cancel()
        step = min(deadline, clock.now() + recancel_s)
        while pending and clock.now() < step:
            await wait_until(clock, pending, step)
            pending = {task for task in pending if not task.done()}
    for task in tasks:
        if task.done():
            _read_outcome(task)
        else:
            task.add_done_callback(_read_outcome)
    return pending


def _read_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
