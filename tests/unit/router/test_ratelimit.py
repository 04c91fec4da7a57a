"""Token buckets, bursts, in-flight caps and per-router shares, under a fake clock."""

from __future__ import annotations

import pytest

from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.router.policy.ratelimit import Quota, RateLimiter, TokenBucket
from sluice_inference.router.policy.shares import Shares, equal_shares


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
    limiter.set_shares(equal_shares(2), now=0.0)
    assert limiter.inflight_cap("t") == 5  # 4.5 rounded to the nearest request
    assert limiter.levels(0.0)["t"] == pytest.approx(5)  # a full bucket clamped to its new size
    admitted = 0
    for step in range(1000):  # 10 s at 100 attempts/s
        try:
            limiter.acquire("t", step * 0.01, busy_retry_s=0.0)
            limiter.release("t")
            admitted += 1
        except SluiceError:
            pass
    assert admitted == pytest.approx(5 + 50 * 10, abs=2)  # its share: 50 req/s plus its half-burst
    limiter.set_shares(equal_shares(1), now=10.0)
    assert limiter.inflight_cap("t") == 9


def test_a_share_that_grows_grants_no_tokens_and_one_that_shrinks_clamps() -> None:
    limiter = RateLimiter({"t": Quota(rate=100, burst=100)}, None, now=0.0)
    limiter.set_shares(Shares(2, {"t": 0.1}, 0.5, follow_demand=True), now=0.0)
    assert limiter.levels(0.0)["t"] == pytest.approx(10)  # clamped from 100
    limiter.set_shares(Shares(2, {"t": 0.9}, 0.5, follow_demand=True), now=0.0)
    assert limiter.levels(0.0)["t"] == pytest.approx(10)  # not 90: growing keeps the level
    assert limiter.levels(0.5)["t"] == pytest.approx(10 + 0.5 * 90)  # and refills at the new rate


@pytest.mark.parametrize(
    ("fraction", "cap"), [(0.0, 1), (0.04, 1), (0.06, 1), (0.5, 5), (0.74, 7), (1.0, 10)]
)
def test_inflight_share_is_rounded_to_the_nearest_request_and_never_zero(fraction: float, cap: int) -> None:
    limiter = RateLimiter({"t": Quota(rate=1, burst=1, max_inflight=10)}, None, now=0.0)
    limiter.set_shares(Shares(4, {"t": fraction}, 0.25, follow_demand=True), now=0.0)
    assert limiter.inflight_cap("t") == cap


def test_a_small_share_hints_no_longer_than_a_token_at_the_equal_split() -> None:
    limiter = RateLimiter({"t": Quota(rate=60, burst=1)}, None, now=0.0)
    limiter.set_shares(Shares(100, {"t": 0.001}, 0.01, follow_demand=True), now=0.0)
    limiter.acquire("t", 0.0, busy_retry_s=0.0)
    error = _exhausted(limiter, "t", 0.0)
    assert error.retry_after_s == pytest.approx(100 / 60)  # not 1 / 0.06 req/s = 16.7 s
    assert "60 req/s" in error.message and "0.06 req/s on this router" in error.message
