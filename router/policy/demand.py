"""Demand: how many requests per second reach this router's quota check, per tenant, lately — what a
router publishes so that every router can compute its share of the cluster-wide quotas
(router/policy/shares.py).

Rules:
- every attempt counts, admitted or refused: a router starved by a small share must still show the demand
  it sees, or its share could never grow;
- a rate is an exponentially decaying count with time constant `window_s`: after a step in the arrival
  rate it has moved 63 % of the way in one window, 86 % in two, 95 % in three; it is read at `now`, so an
  idle tenant's rate decays without any event;
- what is published is bounded whatever happens at the edge: the `MAX_TENANTS` busiest tenants, rates
  rounded to `DIGITS` significant digits, rates under `MIN_RATE` left out, names longer than
  `MAX_NAME` left out, at most `MAX_RECORD_BYTES` of JSON; a peer's record is read with the same bounds
  and anything malformed in it counts as no demand;
- a router republishes only when its demand moved materially (`changed`); how often it may is
  `publish_interval_s`, which keeps the whole cluster under `CLUSTER_PUBLISHES_PER_S` writes a second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, TypeGuard

MAX_TENANTS: Final = 32
"""Tenants in one published record (the busiest): bounds its size and every peer's work to read it."""
MAX_NAME: Final = 128
"""Longer tenant names are left out of records (configured names are far shorter)."""
MAX_RECORD_BYTES: Final = 2048
"""Most bytes of one encoded demand record."""
DIGITS: Final = 3
"""Significant digits of a published rate: finer changes are noise, and records stay small."""
MIN_RATE: Final = 0.05
"""Rates below this (one request in 20 s) are published as nothing."""
REL_CHANGE: Final = 0.2
"""A tenant's rate must move by this fraction (of the larger of old and new) ..."""
ABS_CHANGE: Final = 0.1
"""... plus this many requests per second before a router republishes."""
CLUSTER_PUBLISHES_PER_S: Final = 100.0
"""Most demand records all routers together write per second: each router waits at least
N / CLUSTER_PUBLISHES_PER_S seconds between two (N live routers), so etcd's load is bounded at any N."""


@dataclass(frozen=True)
class Demand:
    """Recent requests per second reaching one router's quota check, by tenant and in total."""

    tenants: Mapping[str, float] = field(default_factory=dict)
    """Per tenant (tenants without demand are absent)."""
    total: float = 0.0
    """All tenants together: the demand on the global limit."""

    def of(self, tenant: str) -> float:
        """The tenant's rate (0 when absent)."""
        return self.tenants.get(tenant, 0.0)

    def lower(self, other: Demand) -> Demand:
        """Tenant by tenant, the smaller of the two (a tenant absent from either has none)."""
        names = self.tenants.keys() & other.tenants.keys()
        lower = {t: min(self.tenants[t], other.tenants[t]) for t in names}
        return Demand(lower, min(self.total, other.total))

    def to_record(self) -> dict[str, object]:
        """The JSON-ready form published in the router's etcd record, within the module's bounds."""
        busiest = sorted(self.tenants.items(), key=lambda kv: (-kv[1], kv[0]))
        kept = {name: _rounded(rate) for name, rate in busiest if len(name) <= MAX_NAME and rate >= MIN_RATE}
        tenants = dict(list(kept.items())[:MAX_TENANTS])
        record: dict[str, object] = {"tenants": tenants, "total": _rounded(self.total)}
        while tenants and len(json.dumps(record)) > MAX_RECORD_BYTES:
            tenants.popitem()  # the least busy go first
        return record

    def as_published(self) -> Demand:
        """What peers read once this demand is published (bounded and rounded): a router counts its own
        demand exactly as they do."""
        return Demand.from_record(self.to_record())

    @staticmethod
    def from_record(record: object) -> Demand:
        """A peer's published demand, read with the same bounds; anything malformed counts as none."""
        if not isinstance(record, dict):
            return NO_DEMAND
        tenants: dict[str, float] = {}
        raw = record.get("tenants")
        if isinstance(raw, dict):
            for name, rate in list(raw.items())[:MAX_TENANTS]:
                if isinstance(name, str) and len(name) <= MAX_NAME and _sane(rate):
                    tenants[name] = float(rate)
        total = record.get("total")
        if _sane(total):
            return Demand(tenants, float(total))
        return Demand(tenants, sum(tenants.values()))


NO_DEMAND: Final = Demand()


def _sane(value: object) -> TypeGuard[int | float]:
    """A finite, non-negative number (not a bool; an integer too large for a float is not sane)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return 0 <= float(value) < math.inf
    except OverflowError:
        return False


def _rounded(rate: float) -> float:
    if rate <= 0:
        return 0.0
    return round(rate, DIGITS - 1 - math.floor(math.log10(rate)))


def changed(before: Demand, after: Demand) -> bool:
    """Whether `after` differs materially from `before`: some rate (a tenant's or the total) moved by more
    than REL_CHANGE of the larger plus ABS_CHANGE. Rates below MIN_RATE count as zero."""

    def moved(old: float, new: float) -> bool:
        old, new = (old if old >= MIN_RATE else 0.0), (new if new >= MIN_RATE else 0.0)
        return abs(new - old) > REL_CHANGE * max(old, new) + ABS_CHANGE

    names = before.tenants.keys() | after.tenants.keys()
    return moved(before.total, after.total) or any(moved(before.of(t), after.of(t)) for t in names)


def publish_interval_s(configured_s: float, routers: int) -> float:
    """How long a router waits between two publishes: the configured interval, stretched with many routers
    so that the cluster writes at most CLUSTER_PUBLISHES_PER_S records a second."""
    return max(configured_s, max(1, routers) / CLUSTER_PUBLISHES_PER_S)


REBASE_AT: Final = 200.0
"""Windows after its anchor at which a meter rebases its sums (exp(200) is far from a float's limit)."""


@dataclass(slots=True)
class _Rate:
    """An exponentially decaying count, kept as a sum of growing weights: each event at t adds
    exp((t - anchor) / window) / window, and the rate at `now` is the sum times exp(-(now - anchor) /
    window). So a meter computes one exponential per event for the tenant's rate and the total together,
    and none for the others' rates (decaying each rate on every event cost two per event)."""

    scaled: float = 0.0


class DemandMeter:
    """Counts attempts per tenant as decaying rates (module rules); forgets tenants gone idle."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._tenants: dict[str, _Rate] = {}
        self._total = _Rate()
        self._anchor: float | None = None
        """The time the sums are scaled to (the first event, moved forward by `_rebase`)."""
        self._latest = -math.inf
        """The latest event: a rate read before it is read at it (time does not run back)."""

    def note(self, tenant: str, now: float) -> None:
        """One request of `tenant` reached the quota check (whatever the answer)."""
        if self._anchor is None:
            self._anchor = now
        elif now - self._anchor > REBASE_AT * self.window_s:
            self._rebase(now)
        weight = math.exp((now - self._anchor) / self.window_s) / self.window_s
        rate = self._tenants.get(tenant)
        if rate is None:
            rate = self._tenants[tenant] = _Rate()
        rate.scaled += weight
        self._total.scaled += weight
        self._latest = max(self._latest, now)

    def _rebase(self, now: float) -> None:
        assert self._anchor is not None
        factor = math.exp(-(now - self._anchor) / self.window_s)
        for rate in self._tenants.values():
            rate.scaled *= factor
        self._total.scaled *= factor
        self._anchor = now

    def current(self, now: float) -> Demand:
        """The rates now; tenants whose rate decayed below MIN_RATE are forgotten."""
        if self._anchor is None:
            return Demand({}, 0.0)
        decay = math.exp(-(max(now, self._latest) - self._anchor) / self.window_s)
        rates = {name: rate.scaled * decay for name, rate in self._tenants.items()}
        for name in [name for name, value in rates.items() if value < MIN_RATE]:
            del self._tenants[name], rates[name]
        return Demand(rates, self._total.scaled * decay)
