"""A model of the front door on a router whose one core is the limit: the real `Door` driven by a simulated
call queue and probe, so a change to the door's law can be weighed in seconds and without noise before it
is measured on the real router (docs/admission.md, "The door's law, modelled").

What is modelled: Poisson arrivals at `rate` into one first-in first-out queue of calls served by one core. A
call the door admits costs `serve_ms` of that core and ends `after_ms` after its turn (the batch and the
forward; a pressed router holds batches, `--after-ms 20`); a refused call costs `refuse_ms`; the probe's call
costs `probe_ms`. The probe follows router/queue_probe.py: one call out at a time, a sample at each mark of
its age (the bound, then each doubling) while it waits and its round trip when it came back before the first,
a pause of `PROBE_EVERY_S` (or `CALM_EVERY_S` while calm), and no probe while the door is fully open until a
call has come in. A call is good when it was admitted and ended within the SLO.

What is not: the router's per-call cost falling as batches grow under load, the loop interleaving the
stages of several calls, the client giving up after its timeout. So the model's figures are a law's
shape (how deep it cuts, how long it stays shut, what it keeps past the limit), not the router's rates.

    python -m sluice_inference.bench.door_model --factors 1.1,1.5,2
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from sluice_inference.router.policy.door import Door
from sluice_inference.router.queue_probe import pause_after


@dataclass(frozen=True, slots=True)
class Costs:
    """What each kind of call costs the router's core, in seconds, and what follows an admitted call's
    turn before it ends."""

    serve_s: float = 0.00055
    refuse_s: float = 0.00025
    probe_s: float = 0.00025
    after_s: float = 0.005

    @property
    def capacity(self) -> float:
        """Calls a second the core serves when it admits all of them."""
        return 1.0 / self.serve_s


@dataclass(slots=True)
class Outcome:
    """One run's count of calls by how they ended, and the door's samples."""

    offered: int = 0
    good: int = 0
    late: int = 0
    refused: int = 0
    gold_offered: int = 0
    gold_good: int = 0
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    """(time, delay, the door's fraction after it) for every sample."""


_ARRIVE, _DONE, _PROBE_SEND, _MARK = range(4)
GOLD, BRONZE = 1, 3
"""The priority levels of the two tenants (`--gold-share`): one level for all calls without it."""


class _Model:
    """The queue, the core and the probe around one Door (module docstring)."""

    def __init__(
        self, door: Door, costs: Costs, *, slo_s: float, seed: int, gold_share: float, warmup_s: float
    ) -> None:
        self.door = door
        self.warmup_s = warmup_s
        self.gold_share = gold_share
        self.costs = costs
        self.slo_s = slo_s
        self.random = random.Random(seed)
        self.events: list[tuple[float, int, int, int]] = []
        self.order = itertools.count()
        self.queue: deque[tuple[float, int]] = deque()
        """(entered, priority level: 0 for the probe) for each call waiting for the core."""
        self.busy = False
        self.outcome = Outcome()
        self.probe_out_since: float | None = None
        self.next_mark = 0.0
        self.mark_version = 0
        self.traffic = False
        self.waiting_for_traffic = False

    def push(self, when: float, kind: int, data: int = 0) -> None:
        heapq.heappush(self.events, (when, next(self.order), kind, data))

    def run(self, rate: float, duration_s: float) -> Outcome:
        self.push(self.random.expovariate(rate), _ARRIVE)
        if self.door.max_delay_s > 0:  # as the router: with the door off nothing is probed
            self.push(0.0, _PROBE_SEND)
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            if kind == _ARRIVE:
                if now >= self.warmup_s + duration_s:
                    continue
                gold = self.random.random() < self.gold_share
                self.queue.append((now, GOLD if gold else BRONZE))
                self.push(now + self.random.expovariate(rate), _ARRIVE)
            elif kind == _DONE:
                self.busy = False
            elif kind == _PROBE_SEND:
                if now >= self.warmup_s + duration_s:
                    continue
                self._send_probe(now)
            elif data == self.mark_version:
                self._mark(now)
            self._serve(now)
        return self.outcome

    def _serve(self, now: float) -> None:
        if self.busy or not self.queue:
            return
        entered, level = self.queue.popleft()
        self.busy = True
        if not level:
            cost = self.costs.probe_s
            self._probe_back(now + cost, now + cost - entered)
        else:
            cost = self._call(now, entered, level)
            self._arrived(now)
        self.push(now + cost, _DONE)

    def _call(self, now: float, entered: float, level: int) -> float:
        """A client call's turn: the door's answer, its cost, and (past the warm-up) how it ended."""
        admitted = self.door.admit(level)
        cost = self.costs.serve_s * self.random.uniform(0.7, 1.3) if admitted else self.costs.refuse_s
        if entered < self.warmup_s:
            return cost
        outcome = self.outcome
        outcome.offered += 1
        outcome.gold_offered += level == GOLD
        if not admitted:
            outcome.refused += 1
        elif now + cost + self.costs.after_s - entered <= self.slo_s:
            outcome.good += 1
            outcome.gold_good += level == GOLD
        else:
            outcome.late += 1
        return cost

    def _arrived(self, now: float) -> None:
        self.traffic = True
        if self.waiting_for_traffic:
            self.waiting_for_traffic = False
            self._send_probe(now)

    def _send_probe(self, now: float) -> None:
        if not self.door.engaged and not self.traffic:
            self.waiting_for_traffic = True
            return
        self.traffic = False
        self.probe_out_since = now
        self.next_mark = self.door.max_delay_s
        self.mark_version += 1
        self.push(now + self.next_mark, _MARK, self.mark_version)
        self.queue.append((now, 0))

    def _mark(self, now: float) -> None:
        assert self.probe_out_since is not None
        self._observe(max(now - self.probe_out_since, self.next_mark), now)
        self.next_mark *= 2
        self.push(self.probe_out_since + self.next_mark, _MARK, self.mark_version)

    def _probe_back(self, when: float, round_trip: float) -> None:
        self.mark_version += 1
        if self.next_mark <= self.door.max_delay_s:
            self._observe(round_trip, when)
        self.probe_out_since = None
        self.push(when + pause_after(self.door), _PROBE_SEND)

    def _observe(self, delay: float, now: float) -> None:
        self.door.observe(delay, now)
        self.outcome.samples.append((now, delay, self.door.fraction))


def run(
    rate: float,
    door: Door,
    costs: Costs = Costs(),
    *,
    slo_s: float = 0.05,
    duration_s: float = 15.0,
    seed: int = 1,
    gold_share: float = 0.0,
    warmup_s: float = 3.0,
) -> Outcome:
    """One run at `rate` calls a second through `door`: `warmup_s` at that rate not counted (as the peer
    harness does), then `duration_s` counted; `gold_share` of the calls come from a tenant of the
    highest level, the rest from one of a lower level."""
    return _Model(door, costs, slo_s=slo_s, seed=seed, gold_share=gold_share, warmup_s=warmup_s).run(
        rate, duration_s
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factors", default="0.9,1.0,1.1,1.2,1.5,2", help="rates, as multiples of capacity")
    parser.add_argument("--bound-ms", type=float, default=30.0)
    parser.add_argument("--sustain-s", type=float, default=1.0)
    parser.add_argument("--gold-share", type=float, default=0.0, help="the highest level's share of calls")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument(
        "--after-ms", type=float, default=Costs().after_s * 1000,
        help="from an admitted call's turn to its answer (a pressed router holds batches: ~20)",
    )  # fmt: skip
    args = parser.parse_args()
    costs = Costs(after_s=args.after_ms / 1000)
    print(f"capacity {costs.capacity:,.0f} calls/s; kept within the SLO, of capacity (gold: of its own)")
    for factor in (float(text) for text in args.factors.split(",")):
        kept, gold = [], []
        for seed in range(args.seeds):
            door = Door(args.bound_ms / 1000, args.sustain_s)
            outcome = run(
                factor * costs.capacity,
                door,
                costs,
                duration_s=args.duration,
                seed=seed,
                gold_share=args.gold_share,
            )
            kept.append(f"{outcome.good / args.duration / costs.capacity:.2f}")
            gold.append(f"{outcome.gold_good / max(1, outcome.gold_offered):.2f}")
        line = f"{factor:4.2f}x: kept {', '.join(kept)}"
        print(line + (f"; gold kept {', '.join(gold)}" if args.gold_share else ""))


if __name__ == "__main__":
    main()
