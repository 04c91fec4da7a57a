"""The router's queues: one lane per batch-compatible (model, version, shape), bounded in count and bytes.

Invariants:
- a queued request is in exactly one lane; the lanes are the only record of what is queued (counts,
  bytes and the soonest latest start are read off them, never kept twice);
- with bounds, no lane holds more than `lane_max_queued` requests and all lanes together no more than
  `max_queued_bytes`: a newcomer that outranks queued work evicts the least important request (worst
  priority; in it the tenant with most queued; of that tenant the newest), otherwise it is refused;
- a lane exists only while it holds requests (`prune`); its statistics and its limits (as the latest
  arrival brought them, recorded by `push` when they change: the one record of them, which the lane's own
  `limits` equals while it exists, and a request queued again after its lane emptied finds them here)
  outlive it until the core forgets its shape (router/policy/shapes.py bounds how many shapes a model
  keeps);
- a refusal is a `QueueFull` (no retry hint: the queues do not estimate drain times; the core turns it
  into UNAVAILABLE `queue_full`), so the queues never call back into the core;
- what the status pass reads (`by_version`, `arrival_rate`) costs one step per non-empty lane and per
  model, however many shapes were ever seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice_inference.router.policy.lane_stats import LaneStats
from sluice_inference.router.policy.lanes import Lane, LaneKey, LaneLimits, QueuedRequest


class QueueFull(Exception):
    """A request does not fit the queue bounds and outranks nothing queued."""


@dataclass(frozen=True)
class VersionQueue:
    """What is queued for one model version, across its lanes."""

    depth: int
    """Requests queued."""
    oldest_age_s: float
    """How long the request that has waited longest has waited (0.0 when none)."""


@dataclass(frozen=True)
class QueueBounds:
    """Limits on queued work."""

    lane_max_queued: int
    max_queued_bytes: int


class Queues:
    """Every lane of one router, with the bounds and the per-lane arrival statistics."""

    def __init__(self, bounds: QueueBounds | None, aging_s: float) -> None:
        self.bounds = bounds
        self.aging_s = aging_s
        self.lanes: dict[LaneKey, Lane] = {}
        self.stats: dict[LaneKey, LaneStats] = {}
        self._arrivals: dict[str, LaneStats] = {}
        """Rows arriving per model, over all its lanes (what the autoscaling signal reads)."""
        self.limits: dict[LaneKey, LaneLimits] = {}
        """Each lane's batching limits, from its model version's registration (the only copy)."""

    def push(self, request: QueuedRequest, limits: LaneLimits | None = None) -> list[QueuedRequest]:
        """Queue a request under its lane's limits (`limits`: as its model version is registered now, then
        recorded; None: as last recorded, for a request queued again), evicting less important work if a
        bound requires it; returns the evicted requests. Raises `QueueFull` when it does not fit and
        outranks nothing."""
        key = request.lane
        lane = self.lanes.get(key)
        if limits is None:
            limits = self.limits[key]
        elif lane is None or lane.limits is not limits:  # a lane's limits are the ones recorded
            self.limits[key] = limits
        if lane is None:
            lane = self.lanes[key] = Lane(key, limits, self.aging_s)
        lane.limits = limits  # the model version's current registration
        bounds = self.bounds
        if bounds is None or (  # within both bounds (most arrivals): nothing to evict
            len(lane) < bounds.lane_max_queued
            and self.queued_bytes() + request.size_bytes <= bounds.max_queued_bytes
        ):
            victims = []
        else:
            victims = self._make_room(lane, request)
            for victim in victims:
                self.remove(victim.request_id)
        lane.push(request)
        stats = self.stats.get(key)
        if stats is None:
            stats = self._new_stats(key)
        stats.arrived(request.arrival, request.rows)  # the model's statistics count it too
        return victims

    def stats_of(self, key: LaneKey) -> LaneStats:
        """The lane's statistics (kept while the lane empties and refills)."""
        stats = self.stats.get(key)
        return self._new_stats(key) if stats is None else stats

    def _new_stats(self, key: LaneKey) -> LaneStats:
        """Fresh statistics for the lane, linked to its model's (which every arrival of the lane counts)."""
        model = self._arrivals.get(key.model)
        if model is None:
            model = self._arrivals[key.model] = LaneStats()
        stats = self.stats[key] = LaneStats(model=model)
        return stats

    def _make_room(self, lane: Lane, request: QueuedRequest) -> list[QueuedRequest]:
        assert self.bounds is not None
        victims: list[QueuedRequest] = []
        if len(lane) >= self.bounds.lane_max_queued:
            victim = lane.victim(request.priority)
            if victim is None:
                raise QueueFull(f"lane {lane.key} holds {len(lane)} requests (its limit)")
            victims.append(victim)
        excess = self.queued_bytes() + request.size_bytes - self.bounds.max_queued_bytes
        for victim in victims:
            excess -= victim.size_bytes
        if excess > 0:
            chosen = {v.request_id for v in victims}
            candidates = sorted(
                (r for other in self.lanes.values() for r in other if r.priority > request.priority),
                key=lambda r: (-r.priority, -r.arrival),
            )
            for candidate in candidates:
                if excess <= 0:
                    break
                if candidate.request_id not in chosen:
                    victims.append(candidate)
                    excess -= candidate.size_bytes
            if excess > 0:
                raise QueueFull(f"queued inputs would exceed {self.bounds.max_queued_bytes} bytes")
        return victims

    def remove(self, request_id: int) -> QueuedRequest | None:
        """Take a queued request out (cancelled, evicted); None if it is not queued."""
        for lane in self.lanes.values():
            if request_id in lane:
                return lane.remove(request_id)
        return None

    def pop_late(self, now: float) -> list[QueuedRequest]:
        """Every queued request whose latest start has come."""
        return [request for lane in self.lanes.values() for request in lane.pop_late(now)]

    def next_late(self) -> float | None:
        """The soonest latest start among queued requests."""
        soonest = math.inf
        for lane in self.lanes.values():
            when = lane.earliest_latest_start()
            if when is not None and when < soonest:
                soonest = when
        return None if math.isinf(soonest) else soonest

    def by_urgency(self, now: float) -> list[Lane]:
        """Non-empty lanes, the one whose most urgent request must start first, first."""
        lanes = [lane for lane in self.lanes.values() if len(lane)]
        if len(lanes) < 2:  # every tick asks: nothing to order
            return lanes
        return sorted(lanes, key=lambda ln: (ln.earliest_latest_start() or now, ln.key))

    def prune(self) -> None:
        """Forget empty lanes (their statistics stay)."""
        for key in [k for k, lane in self.lanes.items() if not len(lane)]:
            del self.lanes[key]

    def forget(self, key: LaneKey) -> None:
        """Drop an idle shape's statistics and limits (and its lane, which must be empty)."""
        lane = self.lanes.get(key)
        assert lane is None or not len(lane), "a lane holding requests is never forgotten"
        self.lanes.pop(key, None)
        self.stats.pop(key, None)
        self.limits.pop(key, None)

    def busy(self, key: LaneKey) -> bool:
        """Whether the lane holds requests."""
        lane = self.lanes.get(key)
        return lane is not None and len(lane) > 0

    def by_version(self, now: float) -> dict[tuple[str, str], VersionQueue]:
        """Depth and oldest wait per model version with anything queued."""
        depth: dict[tuple[str, str], int] = {}
        oldest: dict[tuple[str, str], float] = {}
        for lane in self.lanes.values():
            arrival = lane.oldest_arrival()
            if arrival is None:
                continue
            version = (lane.key.model, lane.key.version)
            depth[version] = depth.get(version, 0) + len(lane)
            oldest[version] = max(oldest.get(version, 0.0), now - arrival)
        return {version: VersionQueue(depth[version], oldest[version]) for version in depth}

    def arrival_rate(self, model: str, now: float) -> float:
        """Rows per second arriving recently for `model`, all versions and shapes together."""
        arrivals = self._arrivals.get(model)
        return 0.0 if arrivals is None else arrivals.rate(now)

    def total_arrival_rate(self, now: float) -> float:
        """Rows per second arriving recently at this router, all models together."""
        return sum(arrivals.rate(now) for arrivals in self._arrivals.values())

    def queued(self) -> int:
        """Requests waiting in lanes."""
        return sum(len(lane) for lane in self.lanes.values())

    def queued_bytes(self) -> int:
        """Input bytes of the requests waiting in lanes."""
        total = 0
        for lane in self.lanes.values():  # asked per arrival: a loop, not a generator
            total += lane.bytes
        return total
