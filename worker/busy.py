"""How busy the device was lately: the share of a sliding window spent on forwards, in O(1) per call.

The window is a ring of `slots` equal slots of time, each holding the busy seconds that fell into it, and a
running total of the ring. A busy span is spread over the slots it covers when it ends (at most slots + 1
of them, however long the span); a query first clears the slots that slid out of the window (each slot is
cleared once per turn of the ring, so queries cost O(1) amortised, never a scan of past spans) and divides
the total by the time the ring covers: the elapsed part of the current slot plus the `slots - 1` before it.
So the answer is exact for that span of time, which lies between `window_s - window_s / slots` and
`window_s`, and a device busy all along reads exactly 1.0.

Invariants: 0 ≤ fraction ≤ 1; only busy time inside the covered span counts; spans must not overlap (one
device runs one forward at a time) and time never goes back. A span still running is not counted until it
ends. No clock is read here: callers pass every time.
"""

from __future__ import annotations

import math


class BusyWindow:
    """Busy seconds per slot over the last `window_s`, and the fraction of that time spent busy."""

    def __init__(self, window_s: float, slots: int) -> None:
        if window_s <= 0 or slots < 2:
            raise ValueError("window_s must be > 0 and slots >= 2")
        self._width = window_s / slots
        self._busy = [0.0] * slots
        self._total = 0.0
        self._newest = 0  # absolute index (time // width) of the newest slot in the ring
        self._started = False

    def add(self, start: float, end: float) -> None:
        """Record that the device was busy from `start` to `end` (seconds on the caller's clock)."""
        if end <= start:
            return
        self._advance(end)
        n = len(self._busy)
        first = max(self._slot(start), self._newest - n + 1)  # older parts already left the window
        for index in range(first, self._newest + 1):
            low, high = index * self._width, (index + 1) * self._width
            share = min(end, high) - max(start, low)
            if share > 0:
                self._busy[index % n] += share
                self._total += share

    def fraction(self, now: float) -> float:
        """Share of the covered span up to `now` that was busy (0 before anything was recorded)."""
        self._advance(now)
        covered = (len(self._busy) - 1) * self._width + (now - self._newest * self._width)
        if covered <= 0:
            return 0.0
        return min(1.0, max(0.0, self._total / covered))

    def _slot(self, when: float) -> int:
        return math.floor(when / self._width)

    def _advance(self, now: float) -> None:
        """Slide the ring so its newest slot holds `now`, clearing the slots that left the window."""
        target = self._slot(now)
        if not self._started:
            self._newest, self._started = target, True
            return
        if target <= self._newest:
            return
        n = len(self._busy)
        if target - self._newest >= n:
            self._busy = [0.0] * n
            self._total = 0.0
        else:
            for index in range(self._newest + 1, target + 1):
                self._total -= self._busy[index % n]
                self._busy[index % n] = 0.0
        self._newest = target
        self._total = max(0.0, self._total)  # float drift from many subtractions must not go negative
