"""The per-worker circuit breaker."""

from __future__ import annotations

from sluice_inference.router.policy.breaker import FIRST_BACKOFF_S, THRESHOLD, CircuitBreaker


def test_opens_after_consecutive_failures_and_half_opens_for_one_probe() -> None:
    breaker = CircuitBreaker()
    for _ in range(THRESHOLD - 1):
        breaker.failure("w", 0.0)
    assert breaker.allows("w", 0.0)
    breaker.failure("w", 0.0)
    assert not breaker.allows("w", 0.5)
    assert breaker.allows("w", FIRST_BACKOFF_S)
    breaker.dispatched("w", FIRST_BACKOFF_S)
    assert not breaker.allows("w", FIRST_BACKOFF_S)  # one probe at a time


def test_a_failed_probe_doubles_the_backoff_and_a_success_closes() -> None:
    breaker = CircuitBreaker()
    for _ in range(THRESHOLD):
        breaker.failure("w", 0.0)
    breaker.dispatched("w", 1.0)
    breaker.failure("w", 1.0)
    assert breaker.reopens_at("w") == 1.0 + 2 * FIRST_BACKOFF_S
    breaker.success("w")
    assert breaker.allows("w", 1.0) and breaker.reopens_at("w") is None


def test_breakers_are_per_worker() -> None:
    breaker = CircuitBreaker()
    for _ in range(THRESHOLD):
        breaker.failure("bad", 0.0)
    assert breaker.allows("good", 0.0) and not breaker.allows("bad", 0.0)
