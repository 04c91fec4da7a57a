"""Idempotency stores: where records live and how waiters learn an outcome. Decisions come from
`sluice_inference.router.policy.idempotency`; these classes only read, write, wait and wake.

Two implementations of `IdempotencyStore`:
- `InProcessIdempotencyStore` (the embedded default): an `IdempotencyTable` plus one asyncio Event per key
  with waiters. Deduplicates within one router.
- `RedisIdempotencyStore`: records shared by every router, so a retry landing on another router is
  deduplicated. Layout (`P` = prefix, default "sluice:"): `P idem:<scoped_key>` → `encode_record(...)`,
  where `<scoped_key>` is SHA-256(tenant, key) — the raw key string never reaches Redis. In-flight records
  expire after the claim's lease (`PX`), completed ones after the record TTL; Redis enforces both, so a
  record read back is live. A claim is one atomic `SET NX PX GET`: it either creates the in-flight record
  (Proceed) or returns the existing one, which `decide` turns into Wait, Replay or Conflict. `complete` and
  `release` are optimistic transactions (WATCH the record, check `may_complete` / `may_release`, MULTI
  write + PUBLISH on the channel named like the record key, EXEC; retried on a concurrent change).
  Waiters subscribe (confirmed) *before* re-reading the record, so no publish is missed, and re-read every
  `recheck_s` anyway, which bounds the delay after a dead owner's lease ends or a lost message.
  Records are sealed with the cluster's HMAC key (`encode_record`); a value that is not (planted, copied
  from another key, corrupted) is treated as absent — counted in `integrity_failures`, never replayed —
  and a claim replaces it with a compare-and-set, so it cannot block its key either. A record of an older
  router's (unsealed) format is refused instead (UNAVAILABLE, fail closed) until it expires.

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
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis
from redis.exceptions import WatchError

from sluice_inference.common.clock import Clock, MonotonicClock, wait_until
from sluice_inference.common.errors import DeadlineExceeded, Unavailable
from sluice_inference.router.policy.idempotency import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RECORDS,
    DEFAULT_RECORD_TTL_S,
    ClaimDecision,
    Conflict,
    IdempotencyTable,
    Pending,
    Proceed,
    Record,
    Replay,
    StoredOutcome,
    Ticket,
    Wait,
    completed,
    conflict_error,
    decide,
    in_flight,
    may_complete,
    may_release,
    on_wake,
    store_down_error,
)
from sluice_inference.router.policy.idempotency_records import RecordRejected, decode_record, encode_record
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.redis_conn import REDIS_ERRORS, Outage, Subscriber

log = logging.getLogger(__name__)

_WATCH_ATTEMPTS = 5
_CLAIM_ATTEMPTS = 3

_REPLACE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
  return 1
end
return 0
"""
"""Replace a rejected record with our claim only if it is still the value we rejected (compare-and-set)."""


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


def _as_bytes(raw: object) -> bytes:
    if isinstance(raw, bytes):
        return raw
    raise ValueError(f"expected bytes from Redis, got {type(raw).__name__}")


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisIdempotencyStore:
    """Records in Redis, shared by every router (see the module docstring for layout and atomicity).
    The Redis client is the caller's (it may be shared with the result cache); `close` leaves it open."""

    def __init__(
        self,
        redis: Redis,
        *,
        keys: SealKeys,
        prefix: str = "sluice:",
        clock: Clock | None = None,
        recheck_s: float = 0.5,
        down_backoff_s: float = 1.0,
        integrity_failed: Callable[[], None] | None = None,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._integrity_failed = integrity_failed
        self._replace = redis.register_script(_REPLACE_SCRIPT)
        self._prefix = prefix
        self._clock = clock or MonotonicClock()
        self._recheck_s = recheck_s
        self._subscriber = Subscriber(redis, clock=self._clock)
        self.outage = Outage("idempotency store", backoff_s=down_backoff_s, clock=self._clock)
        self.stats = IdempotencyStats()

    def record_key(self, scoped_key: str) -> str:
        """The Redis key (and pub/sub channel) of a record."""
        return f"{self._prefix}idem:{scoped_key}"

    async def claim(
        self, scoped_key: str, fingerprint: str, lease_s: float, tenant: str = ""
    ) -> ClaimDecision:
        """One atomic SET NX PX GET; see `IdempotencyStore.claim`. A record that fails its integrity check
        is replaced (compare-and-set) as if absent. Unavailable when Redis is down (Redis bounds its
        memory itself: `maxmemory` with a TTL-aware eviction policy, docs/security.md)."""
        self._check_up()
        ticket = new_ticket(scoped_key, fingerprint, tenant)
        key = self.record_key(scoped_key)
        value = encode_record(in_flight(ticket, 0.0, lease_s), scoped_key=scoped_key, keys=self._keys)
        for _ in range(_CLAIM_ATTEMPTS):
            try:
                old = await self._redis.set(key, value, px=_ms(lease_s), nx=True, get=True)
                existing = None if old is None else self._parse(scoped_key, old)
                if old is not None and existing is None:
                    replaced = await self._replace(keys=[key], args=[_as_bytes(old), value, _ms(lease_s)])
                    if not replaced:
                        continue  # it changed since: read it again
            except REDIS_ERRORS as exc:
                raise self._down(exc) from exc
            self.outage.succeeded()
            decision = Proceed(ticket) if existing is None else decide(existing, ticket=ticket, now=0.0)
            self.stats.count(decision)
            return decision
        self.stats.store_errors += 1
        raise store_down_error("the record kept changing under a rejected value")

    async def complete(
        self, ticket: Ticket, outcome: StoredOutcome, ttl_s: float = DEFAULT_RECORD_TTL_S
    ) -> bool:
        """See `IdempotencyStore.complete`."""
        record = completed(ticket, outcome, 0.0, ttl_s)
        value = encode_record(record, scoped_key=ticket.scoped_key, keys=self._keys)
        stored = await self._transition(ticket, may_complete, value, _ms(ttl_s), b"completed")
        self.stats.completions += stored
        return stored

    async def release(self, ticket: Ticket) -> bool:
        """See `IdempotencyStore.release`."""
        released = await self._transition(ticket, may_release, None, 0, b"released")
        self.stats.releases += released
        return released

    async def wait(self, scoped_key: str, fingerprint: str, timeout_s: float) -> StoredOutcome | None:
        """Subscribe, then re-read until the record settles; see `IdempotencyStore.wait`."""
        self._check_up()
        key = self.record_key(scoped_key)
        deadline = self._clock.now() + timeout_s
        try:
            async with self._subscriber.watch(key) as changed:
                while True:
                    changed.clear()
                    seen = on_wake(await self._read(scoped_key), fingerprint, 0.0)
                    remaining = deadline - self._clock.now()
                    if not isinstance(seen, Pending) or remaining <= 0:
                        return None if isinstance(seen, Pending) else seen
                    woken = asyncio.ensure_future(changed.wait())
                    until = self._clock.now() + min(remaining, self._recheck_s)
                    if not await wait_until(self._clock, {woken}, until):
                        woken.cancel()
        except REDIS_ERRORS as exc:
            raise self._down(exc) from exc

    async def close(self) -> None:
        """Close the shared pub/sub connection."""
        await self._subscriber.close()

    async def _read(self, scoped_key: str) -> Record | None:
        raw = await self._redis.get(self.record_key(scoped_key))
        self.outage.succeeded()
        return None if raw is None else self._parse(scoped_key, raw)

    def _parse(self, scoped_key: str, raw: object) -> Record | None:
        """The record, or None (absent) when it fails its integrity check; Unavailable for an older
        router's format, which may be a live claim this router cannot read (fail closed)."""
        try:
            return self._decode(scoped_key, raw)
        except RecordRejected as exc:
            if not exc.old_format:
                return None
            self.stats.store_errors += 1
            raise Unavailable(
                f"unreadable idempotency record ({exc})",
                reason="idempotency_record_unreadable",
                retry_after_s=1.0,
            ) from exc

    def _decode(self, scoped_key: str, raw: object) -> Record:
        """`decode_record`, counting (and logging) a value that fails its integrity check."""
        try:
            if not isinstance(raw, bytes):
                raise RecordRejected(f"expected bytes from Redis, got {type(raw).__name__}")
            return decode_record(raw, scoped_key=scoped_key, keys=self._keys)
        except RecordRejected as exc:
            if not exc.old_format:
                self.stats.integrity_failures += 1
                log.warning("an idempotency record failed its integrity check (%s): treated as absent", exc)
                if self._integrity_failed is not None:
                    self._integrity_failed()
            raise

    async def _transition(
        self,
        ticket: Ticket,
        allowed: Callable[[Record | None, Ticket, float], bool],
        value: bytes | None,
        px_ms: int,
        note: bytes,
    ) -> bool:
        key = self.record_key(ticket.scoped_key)
        try:
            for _ in range(_WATCH_ATTEMPTS):
                with contextlib.suppress(WatchError):
                    return await self._try_transition(
                        key, ticket, allowed=allowed, value=value, px_ms=px_ms, note=note
                    )
        except REDIS_ERRORS as exc:
            self.outage.failed(exc)
            self.stats.store_errors += 1
            return False
        log.warning("idempotency record kept changing; gave up writing it after %d tries", _WATCH_ATTEMPTS)
        return False

    async def _try_transition(
        self,
        key: str,
        ticket: Ticket,
        *,
        allowed: Callable[[Record | None, Ticket, float], bool],
        value: bytes | None,
        px_ms: int,
        note: bytes,
    ) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.watch(key)
            raw = await pipe.get(key)
            try:
                existing = None if raw is None else self._decode(ticket.scoped_key, raw)
            except RecordRejected:
                existing = None  # unreadable: a completion may replace it, a release never matches it
            if not allowed(existing, ticket, 0.0):
                return False
            pipe.multi()  # type: ignore[no-untyped-call]
            if value is None:
                pipe.delete(key)
            else:
                pipe.set(key, value, px=px_ms)
            pipe.publish(key, note)
            await pipe.execute()
        self.outage.succeeded()
        return True

    def _check_up(self) -> None:
        if self.outage.skipping():
            self.stats.store_errors += 1
            raise store_down_error("Redis unreachable", self.outage.retry_after_s())

    def _down(self, exc: BaseException) -> Unavailable:
        self.outage.failed(exc)
        self.stats.store_errors += 1
        return store_down_error(f"{type(exc).__name__}: {exc}", self.outage.retry_after_s())
