"""`RedisIdempotencyStore`: idempotency records shared by every router through Redis, so a retry landing
on another router is deduplicated (router/stores/idempotency_store.py has the contract and the in-process
store; decisions come from `sluice_inference.router.policy.idempotency`).

Layout (`P` = prefix, default "sluice:"): `P idem:<scoped_key>` → `encode_record(...)`, where `<scoped_key>`
is SHA-256(tenant, key) — the raw key string never reaches Redis. In-flight records expire after the claim's
lease (`PX`), completed ones after the record TTL; Redis enforces both, so a record read back is live. A claim
is one atomic `SET NX PX GET`: it either creates the in-flight record (Proceed) or returns the existing one,
which `decide` turns into Wait, Replay or Conflict. `complete` and `release` are optimistic transactions
(WATCH the record, check `may_complete` / `may_release`, MULTI write + PUBLISH on the channel named like the
record key, EXEC; retried on a concurrent change). Waiters subscribe (confirmed) *before* re-reading the
record, so no publish is missed, and re-read every `recheck_s` anyway, which bounds the delay after a dead
owner's lease ends or a lost message. Records are sealed with the cluster's HMAC key (`encode_record`); a
value that is not (planted, copied from another key, corrupted) is treated as absent — counted in
`integrity_failures`, never replayed — and a claim replaces it with a compare-and-set, so it cannot block its
key either. A record of an older router's (unsealed) format is refused instead (UNAVAILABLE, fail closed)
until it expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import WatchError

from sluice_inference.common.clock import Clock, MonotonicClock, wait_until
from sluice_inference.common.errors import Unavailable
from sluice_inference.router.policy.idempotency import (
    DEFAULT_RECORD_TTL_S,
    ClaimDecision,
    Pending,
    Proceed,
    Record,
    StoredOutcome,
    Ticket,
    completed,
    decide,
    in_flight,
    may_complete,
    may_release,
    on_wake,
    store_down_error,
)
from sluice_inference.router.policy.idempotency_records import RecordRejected, decode_record, encode_record
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.idempotency_store import IdempotencyStats, new_ticket
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
