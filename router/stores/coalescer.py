"""Single flight: concurrent calls with the same key share one execution.

Invariants:
- At most one execution per key is in flight; a call that arrives while one is running awaits it instead
  of starting another, and every caller gets the same result or the same exception.
- The execution runs as its own task, so cancelling one caller never cancels it while another caller still
  waits. When the *last* caller leaves (all cancelled), the execution is cancelled too — no one wants the
  result, and a cancelled request must not keep using device time (docs/design.md §5) — and the key is freed
  at once, so a later call starts afresh instead of inheriting the cancellation.
- A finished execution is forgotten immediately: results are not cached here (that is the result cache's
  job, with its keys, TTLs and bounds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Flight(Generic[T]):
    task: asyncio.Task[T]
    callers: int = 0


@dataclass
class CoalescerStats:
    """Monotonic counters: executions started, and calls that joined one already running."""

    executions: int = 0
    coalesced: int = 0
    abandoned: int = 0


async def _call(factory: Callable[[], Awaitable[T]]) -> T:
    return await factory()


class Coalescer(Generic[T]):
    """Runs `factory()` once per key among concurrent callers of `run(key, factory)`."""

    def __init__(self) -> None:
        self.stats = CoalescerStats()
        self._flights: dict[Hashable, _Flight[T]] = {}

    def in_flight(self) -> int:
        """Keys with an execution running now."""
        return len(self._flights)

    def running(self, key: Hashable) -> bool:
        """Whether a `run(key, ...)` now would join an execution instead of starting one."""
        return key in self._flights

    async def run(self, key: Hashable, factory: Callable[[], Awaitable[T]]) -> T:
        """The result of the execution for `key`: a new one, or the one already in flight."""
        flight = self._flights.get(key)
        if flight is None:
            flight = _Flight(asyncio.create_task(_call(factory), name=f"coalesced:{key!r:.40}"))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda task: self._finished(key, flight, task))
            self.stats.executions += 1
        else:
            self.stats.coalesced += 1
        flight.callers += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.callers -= 1
            if flight.callers == 0 and not flight.task.done():
                self._abandon(key, flight)

    def _abandon(self, key: Hashable, flight: _Flight[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        flight.task.cancel()
        self.stats.abandoned += 1

    def _finished(self, key: Hashable, flight: _Flight[T], task: asyncio.Task[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: every caller may have been cancelled before it failed
