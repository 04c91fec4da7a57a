"""The receive timeout of every request body being read, kept by one timer rather than one per call.

asyncio keeps its timers in a heap ordered by a Python-level comparison (`TimerHandle.__lt__`). A timer
made and cancelled for each call, nearly all of them cancelled long before they are due, cost ~15 µs of
CPU a call in a bare grpc.aio server in the receive gate's shape (`bench/grpc_floor.py`, 1,200 calls a
second, the read with and without its timer: 406 against 390 µs a call, four alternating pairs), about 2 %
of what the router and worker spend on a request. Here each read is an entry in a dict, and one timer
waits for the earliest deadline: it is moved only when a read with an earlier deadline comes in, and a
read that ends leaves the dict, not the timer's heap. When the timer fires, every read past its deadline
has its task cancelled, and the timer is set for the earliest deadline left, no sooner than
`MIN_SWEEP_S` later, so a read is cut at most that late. With no read outstanding there is no timer.

Owned by the receive gate (router/receive_gate.py) and used on the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from sluice_inference.common.clock import Clock, Timer

MIN_SWEEP_S = 0.1
"""The timer fires at most this often while reads are outstanding: how late a read may be cut."""


class ReadDeadlines:
    """Reads in progress, each with its deadline; the task of one past it is cancelled."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._reads: dict[asyncio.Task[Any], float] = {}
        self._cut: set[asyncio.Task[Any]] = set()
        """Tasks cancelled because their read passed its deadline, until their read ends."""
        self._timer: Timer | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        return len(self._reads)

    def start(self, task: asyncio.Task[Any], deadline: float) -> None:
        """`task` reads a body that must have arrived by `deadline` (clock time)."""
        self._reads[task] = deadline
        if deadline < self._timer_at:
            self._arm(deadline)

    def was_cut(self, task: asyncio.Task[Any]) -> bool:
        """Whether `task` was cancelled because its read passed its deadline."""
        return task in self._cut

    def end(self, task: asyncio.Task[Any]) -> None:
        """`task`'s read is over, however it ended."""
        self._reads.pop(task, None)
        self._cut.discard(task)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._clock.call_at(when, self._sweep)

    def _sweep(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = self._clock.now()
        due = [task for task, deadline in self._reads.items() if deadline <= now]
        for task in due:
            del self._reads[task]
            self._cut.add(task)
            task.cancel()
        if self._reads:
            self._arm(max(min(self._reads.values()), now + MIN_SWEEP_S))
