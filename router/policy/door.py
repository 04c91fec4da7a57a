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
cutting at most once per round trip). For a few seconds after it has opened fully, a delay that stays above
the bound for a tenth of a second closes it again, not the whole sustain time: the load that closed it is
most likely back and building a queue, and every call of that queue past the SLO is lost (waiting for
twice the bound first, as the door did until 2026-12-04, kept about half of the core's capacity within
the SLO at 1.05-1.1x that capacity in bench/door_model.py, against 0.8 now: docs/performance.md).
Refusals are spread evenly (a credit counter, not a coin: the admitted rate is smooth) and carry UNAVAILABLE
with a retry hint. A refusal costs gRPC's per-call work and this check: about 1.3x a bare grpc.aio server's
refusal, half of what the router spends serving a request and a quarter of what the router and the worker
spend together (docs/performance.md), which is what keeps some goodput past the router's own saturation.

Tenant-aware: the fraction is the share of all new requests the router can take; who gets it goes by the
calling tenant's priority level (its `default_priority`; 1 is the highest), known from the API key in the
call's metadata before the body is parsed. The door counts arrivals per level and, at each sample,
hands the admitted share out from the highest level down: a level whose recent arrivals fit in what is left
is admitted whole, the first that does not gets the remainder, and every level below it only the floor (a
level with no recent arrivals, the tenant-blind fraction, until its volume is known). And while the wait is
under `PROTECT` times the bound and more than one level is calling, the highest calling level is admitted
whole and a cut never takes the fraction below its share: a queue still draining after a cut, or a short
stall, is paid for by the lower levels, and the highest level is cut only once the wait says it alone is
more than the router takes. Nor does a lower level's burst get the sustain time while a higher level calls:
the door closes on the first late sample (in the two-tenant bench the half second of sustain built a
queue that cost gold 3-4 % of its requests, late), and a late sample is one past half the bound
(`PROTECTED_BOUND`): a protected call still has its batch and forward to wait for after the door. So
under router-bound overload a gold tenant keeps its requests while bronze absorbs the refusals, as long as
gold alone fits in what the router can take; tenants of one level are refused alike.

Pure: delay samples (with their time) come in through `observe`, decisions go out through `admit`; no I/O.
Invariants: `admit` is O(1) (a dict lookup and a counter); the per-level shares are recomputed only at
`observe` (≤ 20 times a second), over at most one entry per priority level ever seen (bounded by the
configured levels: the shell maps anything else to the lowest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

DECREASE: Final = 0.8
"""The admitted fraction's factor per cut (a sample above the delay bound, at most once per delay)."""
INCREASE: Final = 0.05
"""What the admitted fraction regains per sample below half the delay bound (a sample comes every ~50 ms:
from half to all in about half a second)."""
MIN_FRACTION: Final = 0.01
"""Never refuse everything: a trickle of requests keeps the router's estimates and health current. Each
level keeps at least this share of its own arrivals."""
HOLD_MAX_S: Final = 0.1
"""The longest wait between two cuts: a delay of seconds (a queue built before the door closed) must not
leave the door as open as it was for seconds."""
REARM_S: Final = 5.0
"""After the door has opened fully, for this long a delay above the bound closes it again once it has
lasted `REARM_SUSTAIN_S`, not `sustain_s`: the load that closed it is most likely still there, and waiting
`sustain_s` again lets a queue of that length build before every close."""
REARM_SUSTAIN_S: Final = 0.1
"""How long the delay must stay above the bound to close a door that opened fully less than `REARM_S`
ago: the interval of CoDel's rule (a queue that has not drained within it is standing). Closing on a
single late sample made a router near its capacity, where an occasional call waits past the bound and the
next one does not, refuse 5-10 % of a load it could serve (docs/performance.md). Waiting instead for
twice the bound (2026-12-03 to 12-04) let a load of 1.05-1.1x the router's capacity build a queue past
the SLO before every close; without it the router kept as much or more within the SLO at every load
measured, though it closes a little more readily while the machine stalls (docs/performance.md,
2026-12-04)."""
RETRY_AFTER_S: Final = 0.1
"""The retry hint of a refusal: about the time the fraction takes to recover by a tenth."""
MEMORY: Final = 0.7
"""Each sample keeps this much of a level's arrival count from before it: the shares follow the last few
samples (a few hundred ms), steady enough that one quiet sample does not hand a level's share away."""


PROTECT: Final = 2.0
"""Under this many times the bound, a wait does not cut the highest calling level's share (module
docstring)."""
PROTECTED_BOUND = 0.5
"""While a level is protected, the wait that cuts is this share of the bound, and the fraction regains
under half of that: the protected level's calls also spend their budget after the door, on their batch's
wait and forward, which a pressed router stretches (it holds a batch up to `pressure_hold_factor` times
its `max_wait`). Cutting only at the whole bound let them wait long enough to end late: in
bench/door_model.py with 20 ms from a call's turn to its answer, gold kept 0.68-0.72 of its calls at
1.5x the router's capacity with the whole bound and 0.98-1.0 with half (docs/performance.md, 2026-12-04
evening). A single level calling keeps the whole bound: nothing is protected then."""
FORGOTTEN: Final = 0.01
"""A level whose decayed arrivals fall below this counts as silent (its volume unknown again)."""


@dataclass(slots=True)
class _Level:
    """One priority level's arrivals and the share of them the door admits now."""

    arrivals: int = 0
    """Arrivals since the last sample."""
    recent: float = 0.0
    """Arrivals over the last few samples, decayed by `MEMORY` per sample."""
    admitted: float = 1.0
    """Share of this level's new requests admitted now."""
    credit: float = 0.0


@dataclass(slots=True)
class Door:
    """Admits the fraction of new requests the router takes in promptly, highest priority levels first
    (see the module docstring)."""

    max_delay_s: float
    """Delay above which the router refuses part of its new requests; 0 turns the door off."""
    sustain_s: float = 1.0
    """How long the delay must stay above the bound before the door first closes: a burst that drains
    (500 requests at once) or a closed-loop client's standing queue is served, not refused."""
    fraction: float = 1.0
    """Share of all new requests admitted now."""
    delay_s: float = 0.0
    """The latest delay sample."""
    engaged: bool = False
    """Refusing part of the load; until the fraction is back at 1."""
    refused: int = 0
    """Requests refused so far."""
    _above_since: float | None = None
    """Since when the delay has stayed above the bound (None: it is not)."""
    _opened_at: float = float("-inf")
    _hold_until: float = float("-inf")
    _levels: dict[int, _Level] = field(default_factory=dict)

    def router_bound(self) -> bool:
        """Whether calls wait for the router's own code long enough that its CPU is the constraint: the
        latest delay at half the door's bound or more (the adaptive batcher then counts the router's CPU
        per batch, docs/batching.md). Never with the door off: nothing measures the delay then."""
        return self.max_delay_s > 0 and self.delay_s >= self.max_delay_s / 2

    def observe(self, delay_s: float, now: float) -> None:
        """One sample, taken at `now`, of how long a call waits before the router's code runs."""
        self.delay_s = delay_s
        if not self.max_delay_s:
            return
        self._count_arrivals()
        top = self._protected_level(delay_s)
        self._control(delay_s, now, top)
        self._share_out(top)

    def _control(self, delay_s: float, now: float, top: int | None) -> None:
        """The total fraction's AIMD law (module docstring), on a bound of `PROTECTED_BOUND` of the
        configured one while a level is protected."""
        bound = self.max_delay_s if top is None else self.max_delay_s * PROTECTED_BOUND
        if delay_s >= bound:  # a wait that reached it (the whole bound: a probe's first mark) is past it
            if not self.engaged:
                if not self._lasted(now) and top is None:
                    return
                self.engaged = True
            if now >= self._hold_until:
                cut = max(MIN_FRACTION, self.fraction * DECREASE, 0.0 if top is None else self._share_of(top))
                self.fraction = min(self.fraction, cut)
                self._hold_until = now + min(delay_s, HOLD_MAX_S)
            return
        self._above_since = None
        if self.engaged and delay_s < bound / 2:
            self.fraction = min(1.0, self.fraction + INCREASE)
            self.engaged = self.fraction < 1.0
            if not self.engaged:
                self._opened_at = now

    def _lasted(self, now: float) -> bool:
        """Whether the wait, above the bound at `now`, has lasted long enough to close the door: the
        sustain time, or `REARM_SUSTAIN_S` within `REARM_S` of the door's last full opening."""
        self._above_since = now if self._above_since is None else self._above_since
        sustain = min(REARM_SUSTAIN_S, self.sustain_s) if now - self._opened_at < REARM_S else self.sustain_s
        return now - self._above_since >= sustain

    def _count_arrivals(self) -> None:
        """Fold the arrivals since the last sample into each level's decayed count."""
        for level in self._levels.values():
            recent = level.recent * MEMORY + level.arrivals
            level.recent = recent if recent >= FORGOTTEN else 0.0
            level.arrivals = 0

    def _protected_level(self, delay_s: float) -> int | None:
        """The level spared this sample: the highest calling one, while more than one level calls and the
        wait is under `PROTECT` times the bound (module docstring); None otherwise."""
        if delay_s >= PROTECT * self.max_delay_s:
            return None
        calling = [number for number, level in self._levels.items() if level.recent]
        return min(calling) if len(calling) >= 2 else None

    def _share_of(self, number: int) -> float:
        """A level's share of all recent arrivals."""
        return self._levels[number].recent / sum(level.recent for level in self._levels.values())

    def _share_out(self, top: int | None) -> None:
        """Hand the admitted fraction out from the highest priority level (lowest number) down, in
        proportion to each level's recent arrivals; a protected highest level is admitted whole whatever
        its arrivals did since the last sample (a Poisson sample above its average share must not cost it
        requests), the levels below share what is left."""
        total = sum(level.recent for level in self._levels.values())
        left = self.fraction * total  # arrivals' worth the router can take
        for number in sorted(self._levels):
            level = self._levels[number]
            if self.fraction >= 1.0 or number == top:
                level.admitted = 1.0
            elif not level.recent:  # nothing known of its volume yet: the tenant-blind share
                level.admitted = self.fraction
            elif level.recent <= left:
                level.admitted = 1.0
            else:
                level.admitted = max(MIN_FRACTION, left / level.recent)
            left = max(0.0, left - level.recent * level.admitted)

    def admit(self, priority: int) -> bool:
        """Whether the next new request, from a tenant of this priority level, may come in."""
        level = self._levels.get(priority)
        if level is None:  # a level not seen yet gets the tenant-blind share until the next sample
            level = self._levels[priority] = _Level(admitted=min(1.0, self.fraction))
        level.arrivals += 1
        if level.admitted >= 1.0:
            return True
        level.credit += level.admitted
        if level.credit >= 1.0:
            level.credit -= 1.0
            return True
        self.refused += 1
        return False

    def admitted(self, priority: int) -> float:
        """The share of this level's new requests admitted now (1 for a level not seen yet)."""
        level = self._levels.get(priority)
        return 1.0 if level is None else level.admitted
