"""Rate limits and in-flight quotas: token buckets per tenant and global, in-flight caps per tenant.

Every limit is cluster-wide in the config and enforced as a share by each router: with N live routers
(counted from etcd `routers/`), each enforces rate/N, burst/N and max_inflight/N (never below one
request). The approximation is exact when clients spread evenly over routers (client-side round_robin)
and errs on the strict side otherwise: a tenant whose traffic all lands on one router gets 1/N of its
quota (docs/admission.md). Shares change the moment the router count changes; bucket levels are scaled,
not reset, so a rebalance neither grants a burst nor empties a bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.errors import ResourceExhausted


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens per second up to `burst`; `try_take` spends one if available."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    updated: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def try_take(self, now: float, cost: float = 1.0) -> float:
        """Spend `cost` tokens and return 0, or spend nothing and return seconds until they exist."""
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate

    def level(self, now: float) -> float:
        """Tokens available now."""
        self._refill(now)
        return self.tokens

    def rescale(self, rate: float, burst: float, now: float) -> None:
        """New rate and size; the fill ratio is kept."""
        self._refill(now)
        fill = self.tokens / self.burst if self.burst else 0.0
        self.rate, self.burst = rate, burst
        self.tokens = fill * burst


@dataclass(frozen=True)
class Quota:
    """A cluster-wide limit: rate, burst and in-flight cap (None: no cap)."""

    rate: float
    burst: int
    max_inflight: int | None = None


class RateLimiter:
    """Per-tenant and global token buckets plus per-tenant in-flight counts, at this router's share."""

    def __init__(self, tenants: dict[str, Quota], global_quota: Quota | None, now: float) -> None:
        self._routers = 1
        self._quotas = dict(tenants)
        self._global_quota = global_quota
        self._buckets = {name: self._bucket(q, now) for name, q in tenants.items()}
        self._global = self._bucket(global_quota, now) if global_quota else None
        self.inflight: dict[str, int] = dict.fromkeys(tenants, 0)

    def _share(self, amount: float) -> float:
        return amount / self._routers

    def _bucket(self, quota: Quota, now: float) -> TokenBucket:
        return TokenBucket(self._share(quota.rate), max(1.0, self._share(quota.burst)), updated=now)

    @property
    def routers(self) -> int:
        """How many routers share the limits."""
        return self._routers

    def set_routers(self, count: int, now: float) -> None:
        """Rescale every share for `count` live routers (at least 1)."""
        self._routers = max(1, count)
        self.set_quotas(self._quotas, now)

    def set_quotas(self, tenants: dict[str, Quota], now: float) -> None:
        """New per-tenant quotas (live reload); buckets keep their fill ratio, in-flight counts stay."""
        self._quotas = dict(tenants)
        for name, quota in self._quotas.items():
            bucket = self._buckets.get(name)
            if bucket is None:
                self._buckets[name] = self._bucket(quota, now)
                self.inflight.setdefault(name, 0)
            else:
                bucket.rescale(self._share(quota.rate), max(1.0, self._share(quota.burst)), now)
        if self._global is not None and self._global_quota is not None:
            glob = self._global_quota
            self._global.rescale(self._share(glob.rate), max(1.0, self._share(glob.burst)), now)

    def inflight_cap(self, tenant: str) -> int | None:
        """This router's share of the tenant's in-flight cap."""
        cap = self._quotas[tenant].max_inflight
        return None if cap is None else max(1, math.ceil(cap / self._routers))

    def acquire(self, tenant: str, now: float, *, busy_retry_s: float) -> None:
        """Admit one request against every limit, or raise RESOURCE_EXHAUSTED with a retry hint.

        Order: in-flight first (it spends nothing), then the tenant's bucket, then the global one; a
        tenant token is refunded when the global bucket refuses, so a refusal costs the tenant nothing.
        """
        cap = self.inflight_cap(tenant)
        if cap is not None and self.inflight[tenant] >= cap:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {self.inflight[tenant]} requests in flight "
                f"(limit {cap} on this router)",
                reason="tenant_inflight",
                retry_after_s=busy_retry_s,
            )
        bucket = self._buckets[tenant]
        wait = bucket.try_take(now)
        if wait:
            raise ResourceExhausted(
                f"tenant {tenant!r} is over its rate of {self._quotas[tenant].rate:g} req/s",
                reason="tenant_rate",
                retry_after_s=wait,
            )
        if self._global is not None:
            wait = self._global.try_take(now)
            if wait:
                bucket.tokens += 1.0
                raise ResourceExhausted("the cluster is over its global request rate", reason="global_rate",
                                        retry_after_s=wait)  # fmt: skip
        self.inflight[tenant] += 1

    def release(self, tenant: str) -> None:
        """A request admitted by `acquire` has ended."""
        self.inflight[tenant] = max(0, self.inflight[tenant] - 1)

    def levels(self, now: float) -> dict[str, float]:
        """Token levels by tenant (and `*` for the global bucket), for metrics."""
        levels = {name: bucket.level(now) for name, bucket in self._buckets.items()}
        if self._global is not None:
            levels["*"] = self._global.level(now)
        return levels
