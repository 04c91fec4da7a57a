"""The event-loop lag probe that feeds the front door (router/policy/door.py).

A timer asks to run every `PROBE_S`; how late it actually runs is the time a callback waits in the loop's
ready queue, the router's own queue when its CPU is saturated. Each sample goes to the door and to the
metrics. One timer callback per probe: about 200 cheap wake-ups a second.
"""

from __future__ import annotations

import asyncio

from router.metrics import RouterMetrics
from router.policy.door import PROBE_S, Door


class LoopLagProbe:
    """Samples the running loop's lag into a Door."""

    def __init__(self, door: Door, metrics: RouterMetrics, period_s: float = PROBE_S) -> None:
        self._door = door
        self._metrics = metrics
        self._period_s = period_s
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        """Arm the first probe on the running loop."""
        self._arm(asyncio.get_running_loop())

    def stop(self) -> None:
        """Cancel the pending probe."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + self._period_s
        self._handle = loop.call_at(self._due, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        lag = max(0.0, loop.time() - self._due)
        self._door.observe_lag(lag)
        self._metrics.loop_lag.set(lag)
        self._metrics.door_fraction.set(self._door.fraction)
        self._arm(loop)
