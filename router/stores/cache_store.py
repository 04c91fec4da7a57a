"""The two-tier result cache: a per-router byte-bounded LRU (tier 1) in front of an optional shared Redis
(tier 2). Keys come from `sluice_inference.router.policy.cache_keys`, values from
`sluice_inference.router.policy.result_cache.encode_entry`.

Invariants:
- `get` and `put` never raise for Redis trouble: an unreachable, slow or failing Redis is a miss (counted,
  logged once per outage, then skipped for a short back-off), so the cache can only ever cost latency
  bounded by the client's socket timeouts, never availability.
- Every value read, from either tier, is verified against its key and the cluster's HMAC keys
  (`decode_entry`); a rejected value is a miss, is counted in `rejected`, and (unless it is an older
  router's format) in `integrity_failures` and through `integrity_failed` — it is never served. Without
  Redis the entries never leave the process, so a key made for this process is enough; with Redis the
  cluster's `redis.hmac_key` is required.
- A tier-2 hit is promoted to tier 1 for no longer than its remaining Redis TTL.
- Redis sees only digests and outputs: entry keys are cache-key digests, values are stored results plus
  digests, and the per-model index names models and versions by their SHA-256 only.

Redis layout (`P` = prefix, default "sluice:"):
- `P cache:<key>` → entry blob, expiring after `redis_ttl_s`.
- `P cache-index:<sha256(model)>` → sorted set of `<sha256(version)[:16]>:<key>`, scored by the entry's
  expiry (Redis server time, ms). `put` adds to it and trims expired members in one Lua script, so the
  index stays bounded by live entries; `purge_model` walks it to delete a model's (or a version's) entries.
This multi-key script assumes one Redis (or a primary with replicas), not Redis Cluster.

Purges reach this router's tier 1 and the shared tier 2; other routers' tier 1 copies live on until their
TTL unless `purge_model` is called on each router too (the admin command fans out to every live router).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from sluice_inference.common.clock import Clock, MonotonicClock
from sluice_inference.common.errors import Unavailable
from sluice_inference.router.policy.result_cache import (
    ByteLRU,
    CachedResult,
    Rejected,
    decode_entry,
    encode_entry,
    purge_tag,
)
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.redis_conn import REDIS_ERRORS, Outage

log = logging.getLogger(__name__)

_PUT_SCRIPT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now_ms + ttl, ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
redis.call('PEXPIRE', KEYS[2], ttl)
return 1
"""

_PURGE_BATCH = 500


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters (monotonic) and gauges, for the metrics exporter."""

    hits_memory: int
    hits_redis: int
    misses: int
    bypasses: int
    rejected: int
    integrity_failures: int
    """Values that were not sealed for their key by a holder of the cluster's keys (planted, copied,
    corrupted); part of `rejected`."""
    puts: int
    evictions: int
    expired: int
    purged: int
    entries: int
    bytes_used: int
    redis_errors: int
    redis_down: bool

    @property
    def hits(self) -> int:
        """Hits from either tier."""
        return self.hits_memory + self.hits_redis


@dataclass(frozen=True)
class PurgeResult:
    """Entries removed by `purge_model` from this router's memory and from Redis (the same result may be
    counted in both)."""

    memory: int
    redis: int


class ResultCacheStore:
    """Tier 1 (`ByteLRU`) then tier 2 (Redis, when given); see the module invariants. The Redis client is
    the caller's: it may be shared with the idempotency store, and the caller closes it."""

    def __init__(
        self,
        *,
        capacity_bytes: int,
        ttl_s: float,
        redis: Redis | None = None,
        redis_ttl_s: float | None = None,
        prefix: str = "sluice:",
        keys: SealKeys | None = None,
        clock: Clock | None = None,
        down_backoff_s: float = 1.0,
        integrity_failed: Callable[[], None] | None = None,
    ) -> None:
        if keys is None and redis is not None:
            raise ValueError("a Redis tier needs the cluster's HMAC keys (redis.hmac_key)")
        self._memory = ByteLRU(capacity_bytes, ttl_s)
        self._redis = redis
        self._redis_ttl_ms = max(1, round((redis_ttl_s or ttl_s) * 1000))
        self._prefix = prefix
        self._keys = keys or SealKeys([secrets.token_bytes(32)])
        self.clock = clock or MonotonicClock()
        """The cache's time scale (entry TTLs; the gate's audit bans follow it too)."""
        self.outage = Outage("result cache", backoff_s=down_backoff_s, clock=self.clock)
        self._put_script = redis.register_script(_PUT_SCRIPT) if redis is not None else None
        self._integrity_failed = integrity_failed
        self._hits_memory = self._hits_redis = self._misses = 0
        self._bypasses = self._rejected = self._puts = self._integrity_failures = 0

    @property
    def stats(self) -> CacheStats:
        """Counters and gauges now."""
        lru = self._memory.counters
        return CacheStats(
            hits_memory=self._hits_memory,
            hits_redis=self._hits_redis,
            misses=self._misses,
            bypasses=self._bypasses,
            rejected=self._rejected,
            integrity_failures=self._integrity_failures,
            puts=self._puts,
            evictions=lru.evictions,
            expired=lru.expired,
            purged=lru.purged,
            entries=len(self._memory),
            bytes_used=self._memory.bytes_used,
            redis_errors=self.outage.errors,
            redis_down=self.outage.down,
        )

    def record_bypass(self) -> None:
        """Count a request that skipped the cache (`parameters["cache"]=false`)."""
        self._bypasses += 1

    async def get(self, key: str) -> CachedResult | None:
        """The verified entry for `key` from tier 1, else tier 2 (promoted), else None. Never raises."""
        entry = self._get_memory(key)
        if entry is not None:
            self._hits_memory += 1
            return entry
        entry = await self._get_redis(key)
        if entry is None:
            self._misses += 1
            return None
        self._hits_redis += 1
        return entry

    async def put(self, key: str, result_bytes: bytes, *, model: str, model_version: str) -> None:
        """Store a result in both tiers. Never raises."""
        blob = encode_entry(key, result_bytes, model_version, model=model, keys=self._keys)
        self._memory.put(key, blob, self.clock.now(), tag=purge_tag(model, model_version))
        self._puts += 1
        await self._put_redis(key, blob, model, model_version)

    async def discard(self, key: str) -> None:
        """Remove one entry from both tiers (an audit found it wrong). Never raises; the per-model index
        keeps the member until it expires or a purge walks it, which deletes nothing then."""
        self._memory.discard(key)
        if self._redis is None or self.outage.skipping():
            return
        try:
            await self._redis.delete(self._entry_key(key))
        except REDIS_ERRORS as exc:
            self.outage.failed(exc)
            return
        self.outage.succeeded()

    async def purge_model(self, model: str, version: str | None = None) -> PurgeResult:
        """Delete the entries of `model` (one version, or all when None) from tier 1 and Redis.
        An admin operation, so unlike `get`/`put` it raises Unavailable if Redis cannot be reached."""
        if version is None:
            prefix = purge_tag(model)
            in_memory = self._memory.purge(lambda tag: tag.startswith(prefix))
        else:
            exact = purge_tag(model, version)
            in_memory = self._memory.purge(lambda tag: tag == exact)
        if self._redis is None:
            return PurgeResult(memory=in_memory, redis=0)
        try:
            in_redis = await self._purge_redis(model, version)
        except REDIS_ERRORS as exc:
            self.outage.failed(exc)
            raise Unavailable(f"cache purge could not reach Redis: {exc}", reason="cache_store_down") from exc
        return PurgeResult(memory=in_memory, redis=in_redis)

    def _entry_key(self, key: str) -> str:
        return f"{self._prefix}cache:{key}"

    def _index_key(self, model: str) -> str:
        return f"{self._prefix}cache-index:{_sha(model)}"

    def _get_memory(self, key: str) -> CachedResult | None:
        blob = self._memory.get(key, self.clock.now())
        if blob is None:
            return None
        entry = self._verified(key, blob, "memory")
        if entry is None:
            self._memory.discard(key)
        return entry

    def _verified(self, key: str, blob: bytes, tier: str) -> CachedResult | None:
        """The entry, or None (a miss) counted as rejected and, unless an older format, as forged."""
        entry = decode_entry(key, blob, keys=self._keys)
        if isinstance(entry, CachedResult):
            return entry
        self._rejected += 1
        if entry is not Rejected.OLD_FORMAT:
            self._integrity_failures += 1
            log.warning("a %s cache entry failed its integrity check (%s): treated as a miss", tier,
                        entry.value)  # fmt: skip
            if self._integrity_failed is not None:
                self._integrity_failed()
        return None

    async def _get_redis(self, key: str) -> CachedResult | None:
        if self._redis is None or self.outage.skipping():
            return None
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.get(self._entry_key(key))
                pipe.pttl(self._entry_key(key))
                blob, pttl_ms = await pipe.execute()
        except REDIS_ERRORS as exc:
            self.outage.failed(exc)
            return None
        self.outage.succeeded()
        if blob is None:
            return None
        entry = self._verified(key, blob, "Redis")
        if entry is None:
            return None
        ttl_s = pttl_ms / 1000 if pttl_ms > 0 else None
        tag = purge_tag(entry.model, entry.model_version)
        self._memory.put(key, blob, self.clock.now(), tag=tag, ttl_s=ttl_s)
        return entry

    async def _put_redis(self, key: str, blob: bytes, model: str, model_version: str) -> None:
        if self._put_script is None or self.outage.skipping():
            return
        member = f"{_sha(model_version)[:16]}:{key}"
        keys = [self._entry_key(key), self._index_key(model)]
        try:
            await self._put_script(keys=keys, args=[blob, self._redis_ttl_ms, member])
        except REDIS_ERRORS as exc:
            self.outage.failed(exc)
            return
        self.outage.succeeded()

    async def _purge_redis(self, model: str, version: str | None) -> int:
        assert self._redis is not None
        index = self._index_key(model)
        match = f"{_sha(version)[:16]}:*" if version is not None else None
        removed, cursor = 0, 0
        while True:
            cursor, members = await self._redis.zscan(index, cursor, match=match, count=_PURGE_BATCH)
            if members:
                names = [m.decode() if isinstance(m, bytes) else str(m) for m, _score in members]
                entry_keys = [self._entry_key(name.split(":", 1)[1]) for name in names]
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.delete(*entry_keys)
                    pipe.zrem(index, *names)
                    deleted, _ = await pipe.execute()
                removed += int(deleted)
            if cursor == 0:
                break
        if version is None:
            await self._redis.delete(index)
        self.outage.succeeded()
        return removed
