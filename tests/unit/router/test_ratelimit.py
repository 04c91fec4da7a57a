"""Token buckets, bursts, in-flight caps and per-router shares, under a fake clock."""

from __future__ import annotations

import pytest

from common.errors import Code, SluiceError
from router.policy.ratelimit import Quota, RateLimiter, TokenBucket


def test_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(rate=10, burst=5)
    assert [bucket.try_take(0.0) for _ in range(5)] == [0.0] * 5
    assert bucket.try_take(0.0) == pytest.approx(0.1)  # next token in 1/rate
    assert bucket.try_take(0.1) == 0.0
    assert bucket.try_take(0.1) > 0


def test_bucket_never_holds_more_than_its_burst() -> None:
    bucket = TokenBucket(rate=100, burst=3, updated=0.0)
    assert bucket.level(3600.0) == 3


def _exhausted(limiter: RateLimiter, tenant: str, now: float) -> SluiceError:
    with pytest.raises(SluiceError) as caught:
        limiter.acquire(tenant, now, busy_retry_s=0.02)
    assert caught.value.code == Code.RESOURCE_EXHAUSTED and caught.value.retryable
    return caught.value


def test_tenant_rate_limit_hint_is_the_time_to_the_next_token() -> None:
    limiter = RateLimiter({"t": Quota(rate=4, burst=2)}, None, now=0.0)
    limiter.acquire("t", 0.0, busy_retry_s=0.02)
    limiter.acquire("t", 0.0, busy_retry_s=0.02)
    error = _exhausted(limiter, "t", 0.0)
    assert error.reason == "tenant_rate" and error.retry_after_s == pytest.approx(0.25)


def test_inflight_cap_counts_until_release() -> None:
    limiter = RateLimiter({"t": Quota(rate=1000, burst=1000, max_inflight=2)}, None, now=0.0)
    limiter.acquire("t", 0.0, busy_retry_s=0.02)
    limiter.acquire("t", 0.0, busy_retry_s=0.02)
    assert _exhausted(limiter, "t", 0.0).reason == "tenant_inflight"
    limiter.release("t")
    limiter.acquire("t", 0.0, busy_retry_s=0.02)


def test_global_refusal_refunds_the_tenant_token() -> None:
    limiter = RateLimiter({"t": Quota(rate=1, burst=5)}, Quota(rate=1, burst=1), now=0.0)
    limiter.acquire("t", 0.0, busy_retry_s=0.02)
    assert _exhausted(limiter, "t", 0.0).reason == "global_rate"
    assert limiter.levels(0.0)["t"] == pytest.approx(4)


def test_each_of_n_routers_enforces_a_share_and_rebalances_at_once() -> None:
    limiter = RateLimiter({"t": Quota(rate=100, burst=10, max_inflight=9)}, None, now=0.0)
    limiter.set_routers(2, now=0.0)
    assert limiter.inflight_cap("t") == 5
    assert limiter.levels(0.0)["t"] == pytest.approx(5)  # fill ratio kept, size halved
    admitted = 0
    for step in range(1000):  # 10 s at 100 attempts/s
        try:
            limiter.acquire("t", step * 0.01, busy_retry_s=0.0)
            limiter.release("t")
            admitted += 1
        except SluiceError:
            pass
    assert admitted == pytest.approx(5 + 50 * 10, abs=2)  # its share: 50 req/s plus its half-burst
    limiter.set_routers(1, now=10.0)
    assert limiter.inflight_cap("t") == 9
