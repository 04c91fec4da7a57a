"""Rate limits and in-flight quotas: token buckets per tenant and global, in-flight caps per tenant.

Every limit is cluster-wide in the config and enforced as a share by each router: this router enforces
a fraction of each tenant's rate, burst and in-flight cap, and of the global rate and burst — the
fractions come from router/policy/shares.py (following where each tenant's demand arrives, or the equal
split 1/N over N live routers). In-flight caps are whole requests: the exact share rounded to the nearest
integer, never below one. A rebalance never grants tokens: a bucket that grows keeps its level, one that
shrinks is clamped to its new size, so moving shares between routers cannot let a burst through
(docs/admission.md states the bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sluice_inference.common.errors import ResourceExhausted
from sluice_inference.router.policy.shares import Shares, equal_shares


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
        """New rate and size; the level is kept, clamped to the new size (a rescale never grants tokens)."""
        self._refill(now)
        self.rate, self.burst = rate, burst
        self.tokens = min(self.tokens, burst)


@dataclass(frozen=True)
class Quota:
    """A cluster-wide limit: rate, burst and in-flight cap (None: no cap)."""

    rate: float
    burst: int
    max_inflight: int | None = None


class RateLimiter:
    """Per-tenant and global token buckets plus per-tenant in-flight counts, at this router's share."""

    def __init__(self, tenants: dict[str, Quota], global_quota: Quota | None, now: float) -> None:
        self.shares = equal_shares(1)
        self._quotas = dict(tenants)
        self._global_quota = global_quota
        self._buckets = {name: self._bucket(q, self.shares.of(name), now) for name, q in tenants.items()}
        self._global = self._bucket(global_quota, self.shares.cluster, now) if global_quota else None
        self.inflight: dict[str, int] = dict.fromkeys(tenants, 0)
        self._caps: dict[str, int | None] = {}
        """`inflight_cap` by tenant as of the last change of shares or quotas (asked per request)."""

    @staticmethod
    def _bucket(quota: Quota, fraction: float, now: float) -> TokenBucket:
        return TokenBucket(quota.rate * fraction, max(1.0, quota.burst * fraction), updated=now)

    @property
    def routers(self) -> int:
        """How many routers share the limits."""
        return self.shares.routers

    @property
    def quotas(self) -> dict[str, Quota]:
        """The cluster-wide quota of each tenant."""
        return self._quotas

    def set_shares(self, shares: Shares, now: float) -> None:
        """Enforce these fractions of every limit from now on (buckets rescaled, never granted tokens)."""
        self.shares = shares
        self.set_quotas(self._quotas, now)

    def set_quotas(self, tenants: dict[str, Quota], now: float) -> None:
        """New per-tenant quotas (live reload); buckets keep their level, in-flight counts stay."""
        self._quotas = dict(tenants)
        self._caps.clear()
        for name, quota in self._quotas.items():
            fraction = self.shares.of(name)
            bucket = self._buckets.get(name)
            if bucket is None:
                self._buckets[name] = self._bucket(quota, fraction, now)
                self.inflight.setdefault(name, 0)
            else:
                bucket.rescale(quota.rate * fraction, max(1.0, quota.burst * fraction), now)
        if self._global is not None and self._global_quota is not None:
            glob, fraction = self._global_quota, self.shares.cluster
            self._global.rescale(glob.rate * fraction, max(1.0, glob.burst * fraction), now)

    def inflight_cap(self, tenant: str) -> int | None:
        """This router's share of the tenant's in-flight cap: rounded to the nearest request, at least 1."""
        if tenant in self._caps:
            return self._caps[tenant]
        cap = self._quotas[tenant].max_inflight
        share = None if cap is None else max(1, math.floor(cap * self.shares.of(tenant) + 0.5))
        self._caps[tenant] = share
        return share

    def rate_share(self, tenant: str) -> float:
        """This router's share of the tenant's rate, in requests per second."""
        return self._quotas[tenant].rate * self.shares.of(tenant)

    def _hint(self, wait: float, quota: Quota) -> float:
        """The retry hint of a refused token: the wait for the next one here, but never longer than one
        token takes at the equal split. A router holding a small share gets a bigger one as the demand it
        sees is published, and clients that honoured a long hint would hide that demand."""
        return min(wait, self.shares.routers / quota.rate)

    def acquire(self, tenant: str, now: float, *, busy_retry_s: float) -> None:
        """Admit one request against every limit, or raise RESOURCE_EXHAUSTED with a retry hint.

        Order: in-flight first (it spends nothing), then the tenant's bucket, then the global one; a
        tenant token is refunded when the global bucket refuses, so a refusal costs the tenant nothing.
        """
        caps = self._caps
        cap = caps[tenant] if tenant in caps else self.inflight_cap(tenant)  # known: no call per request
        if cap is not None and self.inflight[tenant] >= cap:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {self.inflight[tenant]} requests in flight "
                f"(limit {cap} on this router)",
                reason="tenant_inflight",
                retry_after_s=busy_retry_s,
            )
        self.take(tenant, now)
        self.inflight[tenant] += 1

    def take(self, tenant: str, now: float) -> None:
        """Spend one token of the tenant's bucket and of the global one, or raise RESOURCE_EXHAUSTED with
        a retry hint (a tenant token is refunded when the global bucket refuses). What `acquire` spends,
        without an in-flight slot: for a request answered at once (a cache hit)."""
        bucket = self._buckets[tenant]
        wait = bucket.try_take(now)
        if wait:
            quota = self._quotas[tenant]
            raise ResourceExhausted(
                f"tenant {tenant!r} is over its rate of {quota.rate:g} req/s "
                f"({bucket.rate:.3g} req/s on this router now)",
                reason="tenant_rate",
                retry_after_s=self._hint(wait, quota),
            )
        if self._global is not None and self._global_quota is not None:
            wait = self._global.try_take(now)
            if wait:
                bucket.tokens += 1.0
                raise ResourceExhausted("the cluster is over its global request rate", reason="global_rate",
                                        retry_after_s=self._hint(wait, self._global_quota))  # fmt: skip

    def release(self, tenant: str) -> None:
        """A request admitted by `acquire` has ended."""
        count = self.inflight[tenant]
        if count > 0:  # never below zero (per request: a branch, not `max`)
            self.inflight[tenant] = count - 1

    def levels(self, now: float) -> dict[str, float]:
        """Token levels by tenant (and `*` for the global bucket), for metrics."""
        levels = {name: bucket.level(now) for name, bucket in self._buckets.items()}
        if self._global is not None:
            levels["*"] = self._global.level(now)
        return levels
