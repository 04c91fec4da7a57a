"""The router's CPU pressure: the share of the time its event loop runs or waits to run.

The adaptive batcher holds for fuller batches while this is high (router/policy/batcher.py, "CPU
pressure"). The router cannot see what else runs on its cores: the worker and etcd beside it on a small
host, or its container's neighbours. The kernel's scheduler statistics can, for one thread:
`/proc/thread-self/schedstat` holds the time the thread ran and the time it was runnable but waiting for a
CPU (`run_ns wait_ns slices`). Over an interval, (ran + waited) / interval is how much of the time the loop
wanted a CPU: near 0 while it sleeps in its selector, near 1 when it always has work, whether its own work
fills the CPU or other processes keep it waiting. Time spent throttled by a CPU limit counts as neither;
the front door's delay measures that case (router/policy/door.py).

Where schedstat cannot be read (a kernel built without it), the loop's own CPU time (`time.thread_time`)
stands in: it misses the waiting, so on a shared core it reads low and the hold starts later.

Read on the event loop's own thread (the status pass runs there), a few times a second: one small file.

The smoothed value rises at once and falls gradually. A load step out of idle is what the hold is for: a
router that took half a second to believe a fully busy interval cut small batches meanwhile, and on one
core at ~0.95 of its capacity the backlog of those batches outlasted a 3 s warm-up (docs/performance.md,
"The early morning of 2026-12-05"). Falling slowly keeps one quiet interval inside a busy spell (the
worker's forward took the core) from dropping the hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SMOOTHING = 0.5
"""Weight of the newest interval in the smoothed pressure when it reads lower than the pressure (an
interval that reads higher is taken whole): with a status pass every 0.2 s, a fall shows within about half
a second."""

Times = Callable[[], "tuple[float, float] | None"]
"""Seconds the calling thread has run and waited to run so far; None where the kernel does not say."""


def schedstat_times() -> tuple[float, float] | None:
    """The calling thread's run and run-queue wait seconds from /proc/thread-self/schedstat."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as stat:
            ran_ns, waited_ns, _slices = stat.read().split()
        return int(ran_ns) / 1e9, int(waited_ns) / 1e9
    except (OSError, ValueError):
        return None


def thread_cpu_times() -> tuple[float, float]:
    """The calling thread's CPU seconds and no waiting: the fallback where schedstat is missing."""
    return time.thread_time(), 0.0


class CpuPressure:
    """The event loop's smoothed CPU pressure, 0..1, updated by `sample` (see the module docstring)."""

    def __init__(
        self,
        wall: Callable[[], float] = time.monotonic,
        times: Times = schedstat_times,
        fallback: Callable[[], tuple[float, float]] = thread_cpu_times,
    ) -> None:
        self._wall = wall
        self._times = times
        self._fallback = fallback
        self._use_fallback = times() is None
        self._last: tuple[float, float] | None = None
        """(wall, ran + waited) at the previous sample; None before the first."""
        self.value = 0.0
        """The smoothed pressure after the last sample."""

    def sample(self) -> float:
        """Fold in the interval since the previous call (made on the same thread) and return the smoothed
        pressure (a rise at once, a fall by `SMOOTHING`); the first call only starts the interval."""
        times = None if self._use_fallback else self._times()
        if times is None:
            self._use_fallback = True  # one source throughout: mixing them would read a jump
            times = self._fallback()
        now, busy = self._wall(), times[0] + times[1]
        last, self._last = self._last, (now, busy)
        if last is not None and now > last[0]:
            interval = min(1.0, max(0.0, (busy - last[1]) / (now - last[0])))
            weight = 1.0 if interval > self.value else SMOOTHING
            self.value += weight * (interval - self.value)
        return self.value
