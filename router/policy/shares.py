"""Quota shares: which part of every cluster-wide limit this router enforces, following where demand
arrives (docs/admission.md, "Several routers").

The allocation rule, for one limit L (a tenant's rate, or the global rate), the demand d_r each of the
N live routers published (router/policy/demand.py) and D = Σ d_r, is router r's fraction of L:
- nobody asks (D = 0): the equal split, 1/N;
- otherwise in proportion to demand, d_r / D: above the limit every attempt of the tenant has the same
  chance, L/D, on whichever router it lands; below it, each router's headroom is proportional to its
  demand, so a tenant that sticks to one router can use all of its quota there;
- floor: never below ε/N (ε = `admission.share_floor`), so a router that has just seen its first
  requests of a tenant admits some at once, before its demand is published.
The fractions of routers that count the same demand sum to exactly 1 without the floor; the floor adds
at most ε in all, so Σ shares ≤ L·(1 + ε). The same fraction applies to the tenant's burst and in-flight
cap (router/policy/ratelimit.py).

Views differ while a publish travels, so each router counts its *own* demand exactly as its peers read
it, and is the last to count an increase: a new publish lowers its own count at once (tenant by tenant,
to the smaller of old and new) and counts it in full only `OWN_GRACE_S` after the record was written —
by then its peers, which apply a record as soon as their watch delivers it, have shrunk their shares.
Shrinking is never delayed, so shares that grow wait for the ones that shrink. Without a view of the
peers (the equal mode, or etcd unreachable) every router enforces 1/N, N the live routers it last knew.

N is counted from the records under `routers/`, which anyone who can write etcd can add to, so it is
capped at `admission.max_routers` (M): however many records (and whatever demand in them) etcd holds, a
router's fraction of every limit stays at least ε/M, and the equal split at least 1/M. The demand sums
still count every record; only the count is capped (docs/admission.md, "Records nobody vouches for").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from sluice_inference.router.policy.demand import NO_DEMAND, Demand

OWN_GRACE_S: Final = 0.05
"""How long after its record is written a router waits before counting a higher demand of its own: etcd
delivers a write to every watch within milliseconds, so 50 ms covers a loaded etcd many times over."""


def share_fraction(mine: float, total: float, routers: int, floor: float) -> float:
    """This router's fraction of a limit (module rule): `mine` is its demand, `total` every live router's
    (its own included), `routers` how many are live, `floor` the ε of the floor."""
    n = max(1, routers)
    if total <= 0:
        return 1.0 / n
    return max(floor / n, min(max(0.0, mine), total) / total)


@dataclass(frozen=True)
class Shares:
    """This router's fraction of every limit."""

    routers: int
    """Live routers sharing the limits, this one included."""
    tenants: Mapping[str, float]
    """Fraction of each tenant's rate, burst and in-flight cap (a tenant absent: 1/routers)."""
    cluster: float
    """Fraction of the global rate and burst."""
    follow_demand: bool
    """False: the equal split (configured, or no view of the peers' demand)."""

    def of(self, tenant: str) -> float:
        """The tenant's fraction."""
        return self.tenants.get(tenant, 1.0 / self.routers)


def equal_shares(routers: int) -> Shares:
    """Every limit split evenly over `routers` (at least 1)."""
    n = max(1, routers)
    return Shares(n, {}, 1.0 / n, follow_demand=False)


class ShareBook:
    """The demand this router counts — its own, as published, and each live peer's — and the shares that
    follow from it (module rules). Peers' sums are kept incrementally, so a peer's new record costs the
    size of that record, not of the whole view."""

    def __init__(self, *, follow_demand: bool, floor: float, max_routers: int) -> None:
        self._follow = follow_demand
        self._floor = floor
        self._max_routers = max(1, max_routers)
        self._own = NO_DEMAND
        """Own demand as counted in shares: at most what peers have had an interval to read."""
        self.published = NO_DEMAND
        """The last demand this router published."""
        self._peers: dict[str, Demand] = {}
        self._peer_sums: dict[str, float] = {}
        self._peer_total = 0.0
        self._view = False
        """Whether the peers' demand is known (False before the first view and while it is stale)."""

    @property
    def routers(self) -> int:
        """Live routers, this one included, counted up to `max_routers` (module rules)."""
        return min(len(self._peers) + 1, self._max_routers)

    def set_peers(self, peers: Mapping[str, Demand] | None) -> None:
        """The live peers and their published demand, or None: the view is stale (etcd unreachable), so
        fall back to the equal split over the routers last known."""
        if peers is None:
            self._view = False
            return
        self._view = True
        if peers.keys() != self._peers.keys():
            self._peers = dict(peers)
            self._resum()
            return
        for router, demand in peers.items():
            old = self._peers[router]
            if demand is not old:
                self._add(old, -1.0)
                self._add(demand, 1.0)
                self._peers[router] = demand

    def publish(self, demand: Demand) -> None:
        """This router publishes `demand` now: counted at once where lower, in full from `promote`."""
        self._own = self._own.lower(demand)
        self.published = demand

    def promote(self) -> None:
        """The last publish was written `OWN_GRACE_S` ago: the peers have read it, count it in full."""
        self._own = self.published

    def shares(self, tenants: Iterable[str]) -> Shares:
        """This router's fraction of each tenant's limits and of the global ones."""
        if not (self._follow and self._view):
            return equal_shares(self.routers)
        n, floor, own = self.routers, self._floor, self._own
        fractions = {
            name: share_fraction(own.of(name), own.of(name) + self._peer_sums.get(name, 0.0), n, floor)
            for name in tenants
        }
        cluster = share_fraction(own.total, own.total + self._peer_total, n, floor)
        return Shares(n, fractions, cluster, follow_demand=True)

    def _resum(self) -> None:
        self._peer_sums, self._peer_total = {}, 0.0
        for demand in self._peers.values():
            self._add(demand, 1.0)

    def _add(self, demand: Demand, sign: float) -> None:
        for name, rate in demand.tenants.items():
            value = self._peer_sums.get(name, 0.0) + sign * rate
            if value > 1e-9:
                self._peer_sums[name] = value
            else:
                self._peer_sums.pop(name, None)
        self._peer_total = max(0.0, self._peer_total + sign * demand.total)
