"""Per-lane signals for adaptive batching: the arrival rate and how much of their budget requests use.

Both are kept per LaneKey by the dispatcher (they outlive a lane that empties and refills). The arrival
rate is a time-decayed count (time constant `TAU_S`), so it follows load changes within about a second
without reacting to a single burst; latency health is the 99th percentile of the fraction of its deadline
budget each recent request used, with hysteresis so the batching mode does not flap.

The percentile is read on every finished request, so the window is also kept sorted (one binary search and
one insertion per request instead of sorting the window each time): `ordered` holds exactly the values of
`fractions`, in order.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

TAU_S = 1.0
WINDOW = 256
HEALTHY_BELOW = 0.4
UNHEALTHY_ABOVE = 0.6


@dataclass(slots=True)
class LaneStats:
    """Arrival rate and latency health of one lane."""

    count: float = 0.0
    last: float | None = None
    fractions: deque[float] = field(default_factory=deque)
    """The last WINDOW budget fractions, oldest first."""
    ordered: list[float] = field(default_factory=list)
    """The same values, sorted."""
    healthy: bool = False

    def arrived(self, now: float, rows: int = 1) -> None:
        """Count `rows` arriving at `now`."""
        if self.last is not None and now > self.last:
            self.count *= math.exp(-(now - self.last) / TAU_S)
        self.last = now if self.last is None else max(self.last, now)
        self.count += rows

    def rate(self, now: float) -> float:
        """Rows per second arriving recently."""
        if self.last is None:
            return 0.0
        return self.count * math.exp(-max(0.0, now - self.last) / TAU_S) / TAU_S

    def finished(self, budget_fraction: float) -> None:
        """A request of this lane completed using `budget_fraction` of its deadline budget."""
        if len(self.fractions) >= WINDOW:
            oldest = self.fractions.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, oldest)]
        self.fractions.append(budget_fraction)
        bisect.insort(self.ordered, budget_fraction)
        p99 = self.p99()
        if self.healthy and p99 > UNHEALTHY_ABOVE:
            self.healthy = False
        elif not self.healthy and p99 < HEALTHY_BELOW and len(self.fractions) >= 20:
            self.healthy = True

    def p99(self) -> float:
        """99th percentile of the recent budget fractions (1.0 when nothing was measured)."""
        ordered = self.ordered
        if not ordered:
            return 1.0
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
