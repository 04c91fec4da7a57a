"""Per-lane signals for adaptive batching: the arrival rate and how much of their budget requests use.

Both are kept per LaneKey by the queues (they outlive a lane that empties and refills). The arrival
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
from typing import Final

TAU_S: Final = 1.0
WINDOW: Final = 256
HEALTHY_BELOW: Final = 0.4
UNHEALTHY_ABOVE: Final = 0.6
_P99_AT: Final = [max(0, min(n - 1, math.ceil(0.99 * n) - 1)) for n in range(WINDOW + 1)]
"""Index of the 99th percentile in a sorted window of n values (read once per finished request)."""


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
    model: LaneStats | None = None
    """The statistics of the lane's whole model, which count the lane's arrivals too (None: these are
    a model's)."""

    def arrived(self, now: float, rows: int = 1) -> None:
        """Count `rows` arriving at `now`, here and in the linked model's statistics (one call for both:
        it runs per request). The two were last counted at the same instant whenever the model's other
        lanes had no arrival since: then they decay by the same factor, computed once."""
        stats: LaneStats | None = self
        decayed_from, decay = None, 1.0
        while stats is not None:
            last = stats.last
            if last is None:
                stats.last = now
            elif now > last:
                if last != decayed_from:
                    decayed_from, decay = last, math.exp(-(now - last) / TAU_S)
                stats.count *= decay
                stats.last = now
            stats.count += rows
            stats = stats.model

    def rate(self, now: float) -> float:
        """Rows per second arriving recently."""
        if self.last is None:
            return 0.0
        return self.count * math.exp(-max(0.0, now - self.last) / TAU_S) / TAU_S

    def finished(self, budget_fraction: float) -> None:
        """A request of this lane completed using `budget_fraction` of its deadline budget."""
        fractions, ordered = self.fractions, self.ordered
        count = len(fractions)  # after this one: one more, up to WINDOW
        if count >= WINDOW:
            del ordered[bisect.bisect_left(ordered, fractions.popleft())]
        else:
            count += 1
        fractions.append(budget_fraction)
        bisect.insort(ordered, budget_fraction)
        p99 = ordered[_P99_AT[count]]
        if self.healthy:
            if p99 > UNHEALTHY_ABOVE:
                self.healthy = False
        elif p99 < HEALTHY_BELOW and count >= 20:
            self.healthy = True

    def p99(self) -> float:
        """99th percentile of the recent budget fractions (1.0 when nothing was measured)."""
        ordered = self.ordered
        if not ordered:
            return 1.0
        return ordered[_P99_AT[len(ordered)]]
