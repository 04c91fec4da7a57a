"""Time as an injected object, so policy code is deterministic under test and in the simulator.

Every `now` the policy core (router/policy/) is given is a float of seconds on a monotonic scale owned by a
Clock: the shell reads it and passes it in, the core never reads time itself. Deadlines are absolute times
on that scale, set once at admission. Production uses `MonotonicClock`; tests and the simulator use
`FakeClock`, which moves only when told to.

Not yet true of the shells (issue 19, point 6): some timers and sleeps in router/ and worker/ still use the
event loop's clock (`loop.time()`, `call_later`/`call_at`, `asyncio.sleep`, `asyncio.wait_for`) or
`time.monotonic` directly. On Linux these read the same monotonic scale as `MonotonicClock`, so the times
agree in production, but a `FakeClock` cannot drive those waits.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of monotonic time in seconds."""

    def now(self) -> float:
        """Current time in seconds; only differences are meaningful."""
        ...


class MonotonicClock:
    """The process's monotonic clock (what production uses)."""

    def now(self) -> float:
        """`time.monotonic()`."""
        return time.monotonic()


class FakeClock:
    """A clock that stands still until `advance` or `jump_to` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        """The current virtual time."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move forward by `seconds` (never backwards)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._now += seconds

    def jump_to(self, when: float) -> None:
        """Move forward to absolute time `when` (no-op if already past it)."""
        self._now = max(self._now, when)
