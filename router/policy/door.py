"""The front door: refuse new inference requests before they are parsed while requests wait too long to
reach the router's code.

Admission control (admission.py) protects the workers: it sees each request with its tenant, lane and
deadline, and refuses what the workers cannot serve in time. It cannot protect the router itself. When the
router's CPU is the limit, requests wait in gRPC's queue of calls not yet handed to Python (a grpc.aio
server takes them one at a time, a few event-loop turns each) and admission sees them only once their
deadline has gone: every request then costs a full parse, decode and queue visit, and the router serves
nothing in time (goodput 0 at 1.6x its saturation rate, issue 11).

The door watches how long a call waits before the router's code runs, measured by the router calling itself
(router/queue_probe.py: an empty `ModelInfer` over a private socket of the same server, so it waits in the
same queue as client inference calls). Once that delay has stayed above `max_delay_s` for `sustain_s` (a burst
that drains, or the standing queue of a closed-loop client with many calls in flight, is served, not refused),
the admitted fraction of new requests shrinks multiplicatively on a sample above the bound, at most once per
measured delay (the calls already queued when the door closed still arrive late for about that long: reacting
to each of their samples closed the door far past the point of relief and halved goodput at 1.4x the router's
saturation), and grows back additively with every sample below half of it, until all are admitted again (AIMD,
as TCP does for the same problem: find the rate a shared resource sustains without measuring it directly,
cutting at most once per round trip). For a few seconds after it has opened fully, a late sample closes it
again at once. Refusals are spread evenly (a credit counter, not a coin: the admitted rate is smooth) and
carry UNAVAILABLE with a retry hint. A refusal costs gRPC's per-call work and this check: ~0.3 ms of CPU,
about a sixth of serving a request here (docs/performance.md), which is what keeps some goodput past the
router's own saturation.

Pure: delay samples (with their time) come in through `observe`, decisions go out through `admit`; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

DECREASE = 0.8
"""The admitted fraction's factor per cut (a sample above the delay bound, at most once per delay)."""
INCREASE = 0.05
"""What the admitted fraction regains per sample below half the delay bound (a sample comes every ~50 ms:
from half to all in about half a second)."""
MIN_FRACTION = 0.01
"""Never refuse everything: a trickle of requests keeps the router's estimates and health current."""
HOLD_MAX_S = 0.1
"""The longest wait between two cuts: a delay of seconds (a queue built before the door closed) must not
leave the door as open as it was for seconds."""
REARM_S = 5.0
"""After the door has opened fully, for this long a late sample closes it again at once, without the
sustain wait: the load that closed it is most likely still there, and waiting `sustain_s` again lets a
queue of that length build before every close."""
RETRY_AFTER_S = 0.1
"""The retry hint of a refusal: about the time the fraction takes to recover by a tenth."""


@dataclass(slots=True)
class Door:
    """Admits the fraction of new requests the router takes in promptly (see the module docstring)."""

    max_delay_s: float
    """Delay above which the router refuses part of its new requests; 0 turns the door off."""
    sustain_s: float = 1.0
    """How long the delay must stay above the bound before the door first closes: a burst that drains
    (500 requests at once) or a closed-loop client's standing queue is served, not refused."""
    fraction: float = 1.0
    """Share of new requests admitted now."""
    delay_s: float = 0.0
    """The latest delay sample."""
    engaged: bool = False
    """Refusing part of the load; until the fraction is back at 1."""
    refused: int = 0
    """Requests refused so far."""
    _above_since: float | None = None
    _opened_at: float = float("-inf")
    _hold_until: float = float("-inf")
    _credit: float = 0.0

    def observe(self, delay_s: float, now: float) -> None:
        """One sample, taken at `now`, of how long a call waits before the router's code runs."""
        self.delay_s = delay_s
        if not self.max_delay_s:
            return
        if delay_s > self.max_delay_s:
            if not self.engaged:
                self._above_since = now if self._above_since is None else self._above_since
                recently_open = now - self._opened_at < REARM_S
                if now - self._above_since < self.sustain_s and not recently_open:
                    return
                self.engaged = True
            if now >= self._hold_until:
                self.fraction = max(MIN_FRACTION, self.fraction * DECREASE)
                self._hold_until = now + min(delay_s, HOLD_MAX_S)
            return
        self._above_since = None
        if self.engaged and delay_s < self.max_delay_s / 2:
            self.fraction = min(1.0, self.fraction + INCREASE)
            self.engaged = self.fraction < 1.0
            if not self.engaged:
                self._opened_at = now

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
