"""Idempotency stores: where records live and how waiters learn an outcome. Decisions come from
`sluice_inference.router.policy.idempotency`; these classes only read, write, wait and wake.

Two implementations of `IdempotencyStore`:
- `InProcessIdempotencyStore` (the embedded default): an `IdempotencyTable` plus one asyncio Event per key
  with waiters. Deduplicates within one router.
- `RedisIdempotencyStore` (router/stores/redis_idempotency.py, where its layout and transactions are
  described): records shared by every router, so a retry landing on another router is deduplicated.

Failure modes: a keyed request must not run twice, so when Redis is unreachable `claim` and `wait` raise
`Unavailable(reason="idempotency_store_down")` with a retry hint (fail closed), quickly: socket timeouts
are short and, after a failure, Redis is skipped for a back-off. `complete` and `release` never raise: the
owner already has its answer, so a lost write only means a later duplicate waits out the lease and
executes again.

`acquire` is the loop the idempotency gate runs for the data plane: claim, wait while another caller
executes, claim again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Protocol

from sluice_inference.common.clock import Clock, MonotonicClock, wait_until
from sluice_inference.common.errors import DeadlineExceeded
from sluice_inference.router.policy.idempotency import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RECORDS,
    DEFAULT_RECORD_TTL_S,
    ClaimDecision,
    Conflict,
    IdempotencyTable,
    Pending,
    Proceed,
    Replay,
    StoredOutcome,
    Ticket,
    Wait,
    conflict_error,
    on_wake,
)

log = logging.getLogger(__name__)


def new_ticket(scoped_key: str, fingerprint: str, tenant: str) -> Ticket:
    """A claim attempt with a fresh random owner token."""
    return Ticket(scoped_key=scoped_key, fingerprint=fingerprint, token=secrets.token_hex(16), tenant=tenant)


@dataclass
class IdempotencyStats:
    """Monotonic counters for metrics."""

    proceeds: int = 0
    waits: int = 0
    replays: int = 0
    conflicts: int = 0
    completions: int = 0
    releases: int = 0
    store_errors: int = 0
    integrity_failures: int = 0
    """Records read that were not sealed for their key by a holder of the cluster's keys (treated as
    absent)."""

    def count(self, decision: ClaimDecision) -> None:
        """Count one claim's decision."""
        if isinstance(decision, Proceed):
            self.proceeds += 1
        elif isinstance(decision, Wait):
            self.waits += 1
        elif isinstance(decision, Replay):
            self.replays += 1
        else:
            self.conflicts += 1


class IdempotencyStore(Protocol):
    """Where idempotency records live (see the module docstring for the contract)."""

    stats: IdempotencyStats

    async def claim(
        self, scoped_key: str, fingerprint: str, lease_s: float, tenant: str = ""
    ) -> ClaimDecision:
        """Proceed (now the owner for `lease_s`), Wait, Replay or Conflict; `tenant` owns the record."""
        ...

    async def complete(
        self, ticket: Ticket, outcome: StoredOutcome, ttl_s: float = DEFAULT_RECORD_TTL_S
    ) -> bool:
        """Store the outcome for replay for `ttl_s`; whether it was written. Never raises."""
        ...

    async def release(self, ticket: Ticket) -> bool:
        """Free the owner's claim so a retry executes; whether it was freed. Never raises."""
        ...

    async def wait(self, scoped_key: str, fingerprint: str, timeout_s: float) -> StoredOutcome | None:
        """The outcome once the in-flight request completes; None if it was released or expired, or
        `timeout_s` passed (claim again)."""
        ...

    async def close(self) -> None:
        """Release what the store holds (not a Redis client it was given)."""
        ...


async def acquire(
    store: IdempotencyStore,
    scoped_key: str,
    fingerprint: str,
    *,
    lease_s: float,
    wait_s: float,
    clock: Clock,
    tenant: str = "",
) -> Proceed | Replay:
    """Claim the key, waiting up to `wait_s` while another caller executes the same request.

    Returns Proceed (execute, then `complete` or `release` the ticket) or Replay. Raises FailedPrecondition
    on a conflict, DeadlineExceeded if the other execution is still running after `wait_s`, Unavailable
    if the store is down.
    """
    deadline = clock.now() + wait_s
    while True:
        decision = await store.claim(scoped_key, fingerprint, lease_s, tenant)
        if isinstance(decision, Proceed | Replay):
            return decision
        if isinstance(decision, Conflict):
            raise conflict_error()
        remaining = deadline - clock.now()
        if remaining <= 0:
            raise DeadlineExceeded(
                "deadline passed while the same request (same idempotency-key) was still executing",
                reason="idempotency_wait",
            )
        outcome = await store.wait(scoped_key, fingerprint, remaining)
        if outcome is not None:
            return Replay(outcome)


class InProcessIdempotencyStore:
    """Records in this process (bounded in count and bytes with per-tenant shares, TTL); waiters woken by
    asyncio Events."""

    def __init__(
        self,
        *,
        max_records: int = DEFAULT_MAX_RECORDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Clock | None = None,
    ) -> None:
        self.table = IdempotencyTable(max_records, max_bytes)
        self.stats = IdempotencyStats()
        self._clock = clock or MonotonicClock()
        self._changed: dict[str, asyncio.Event] = {}

    async def claim(
        self, scoped_key: str, fingerprint: str, lease_s: float, tenant: str = ""
    ) -> ClaimDecision:
        """See `IdempotencyStore.claim`."""
        ticket = new_ticket(scoped_key, fingerprint, tenant)
        decision = self.table.claim(ticket, self._clock.now(), lease_s)
        self.stats.count(decision)
        return decision

    async def complete(
        self, ticket: Ticket, outcome: StoredOutcome, ttl_s: float = DEFAULT_RECORD_TTL_S
    ) -> bool:
        """See `IdempotencyStore.complete`."""
        stored = self.table.complete(ticket, outcome, self._clock.now(), ttl_s)
        self.stats.completions += stored
        self._wake(ticket.scoped_key)
        return stored

    async def release(self, ticket: Ticket) -> bool:
        """See `IdempotencyStore.release`."""
        released = self.table.release(ticket, self._clock.now())
        self.stats.releases += released
        self._wake(ticket.scoped_key)
        return released

    async def wait(self, scoped_key: str, fingerprint: str, timeout_s: float) -> StoredOutcome | None:
        """See `IdempotencyStore.wait`; also returns None when the owner's lease ends."""
        deadline = self._clock.now() + timeout_s
        while True:
            now = self._clock.now()
            seen = on_wake(self.table.lookup(scoped_key, now), fingerprint, now)
            if not isinstance(seen, Pending):
                return seen
            remaining = min(deadline, seen.until) - now
            if remaining <= 0:
                return None
            changed = asyncio.ensure_future(self._changed.setdefault(scoped_key, asyncio.Event()).wait())
            if not await wait_until(self._clock, {changed}, now + remaining):
                changed.cancel()

    async def close(self) -> None:
        """Nothing to release."""

    def _wake(self, scoped_key: str) -> None:
        # Pop, then set: woken waiters re-read the table, and later waiters get a fresh Event.
        changed = self._changed.pop(scoped_key, None)
        if changed is not None:
            changed.set()
