"""The front door: refuse new inference requests before they are parsed while the router's own event loop
is overloaded.

Admission control (admission.py) protects the workers: it sees each request with its tenant, lane and
deadline, and refuses what the workers cannot serve in time. It cannot protect the router itself. When the
router's CPU is the limit, requests wait in gRPC's receive queue and in the event loop's ready queue, and
admission sees them only once their deadline has gone: every request then costs a full parse, decode and
queue visit, and the router serves nothing in time (goodput 0 at 1.6x its saturation rate, issue 11).

The door watches the one signal that queue leaves: event-loop lag, how late a timer that should fire
every `PROBE_S` fires. While the lag stays above `max_lag_s` the admitted fraction of new requests shrinks
multiplicatively; while it stays below half of it the fraction grows back additively (AIMD, as TCP does for
the same problem: find the rate a shared resource sustains without measuring it directly). Refusals are
spread evenly (a credit counter, not a coin: the admitted rate is smooth) and carry UNAVAILABLE with a
retry hint. A refusal costs only gRPC's per-call work and this check, far less than serving, which is what
keeps the router's goodput up past its own saturation.

Pure: the lag comes in through `observe_lag`, decisions go out through `admit`; no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_S = 0.005
"""How often the event-loop lag is sampled (router/loop_lag.py)."""
DECREASE = 0.8
"""The admitted fraction's factor per sample above the lag bound."""
INCREASE = 0.01
"""What the admitted fraction regains per sample below half the lag bound (to 1 in 0.5 s of samples)."""
MIN_FRACTION = 0.01
"""Never refuse everything: a trickle of requests keeps the router's estimates and health current."""
RETRY_AFTER_S = 0.1
"""The retry hint of a refusal: about the time the fraction takes to recover by a tenth."""


@dataclass(slots=True)
class Door:
    """Admits the fraction of new requests the router's event loop can take (see the module docstring)."""

    max_lag_s: float
    """Lag above which the router refuses part of its new requests; 0 turns the door off."""
    fraction: float = 1.0
    """Share of new requests admitted now."""
    lag_s: float = 0.0
    """The latest lag sample."""
    refused: int = 0
    """Requests refused so far."""
    _credit: float = 0.0

    def observe_lag(self, lag_s: float) -> None:
        """One lag sample: how late the probe timer fired."""
        self.lag_s = lag_s
        if not self.max_lag_s:
            return
        if lag_s > self.max_lag_s:
            self.fraction = max(MIN_FRACTION, self.fraction * DECREASE)
        elif lag_s < self.max_lag_s / 2:
            self.fraction = min(1.0, self.fraction + INCREASE)

    def admit(self) -> bool:
        """Whether the next new request may come in."""
        if self.fraction >= 1.0:
            return True
        self._credit += self.fraction
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        self.refused += 1
        return False
