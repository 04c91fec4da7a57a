"""The router's shared stores as `sluice.yaml` configures them: how to reach Redis, the keys that seal what
is written there, the result cache and the idempotency records (router/main.py builds them once at start).
"""

from __future__ import annotations

from redis.asyncio import Redis

from sluice_inference.common.clock import Clock
from sluice_inference.common.config import SluiceConfig
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.router.stores.idempotency_store import IdempotencyStore, InProcessIdempotencyStore
from sluice_inference.router.stores.redis_conn import RedisOptions
from sluice_inference.router.stores.redis_idempotency import RedisIdempotencyStore


def redis_options(config: SluiceConfig) -> RedisOptions:
    """How to reach the cluster's Redis (only with `redis.url` set)."""
    redis = config.redis
    assert redis.url is not None
    return RedisOptions(
        url=redis.url,
        username=redis.username,
        password=redis.password_value(),
        ca_file=redis.ca_file,
        cert_file=redis.cert_file,
        key_file=redis.key_file,
        prefix=redis.prefix,
        socket_timeout_s=redis.timeout_s,
        connect_timeout_s=redis.timeout_s,
        pool_timeout_s=redis.timeout_s,
    )


def seal_keys(config: SluiceConfig) -> SealKeys | None:
    """The cluster's Redis HMAC keys (None without `redis.hmac_key`: in-process stores only)."""
    keys = config.redis.hmac_keys()
    return SealKeys(keys) if keys else None


def cache_store(
    config: SluiceConfig, redis: Redis | None, clock: Clock, metrics: RouterMetrics
) -> ResultCacheStore:
    """The result cache: this router's bounded in-memory tier, over Redis when there is one (entries
    sealed with the cluster's HMAC key)."""
    cache = config.cache
    return ResultCacheStore(
        capacity_bytes=cache.memory_bytes,
        ttl_s=cache.ttl_s,
        redis=redis,
        prefix=config.redis.prefix,
        keys=seal_keys(config),
        clock=clock,
        integrity_failed=metrics.store_integrity_failures.labels("cache").inc,
    )


def idempotency_store(
    config: SluiceConfig, redis: Redis | None, clock: Clock, metrics: RouterMetrics
) -> IdempotencyStore:
    """Idempotency records: in Redis, sealed, when the cluster has one with an HMAC key (shared by every
    router); else in this process, bounded in records and bytes."""
    keys = seal_keys(config)
    if redis is None or keys is None:
        idempotency = config.idempotency
        return InProcessIdempotencyStore(
            max_records=idempotency.max_records, max_bytes=idempotency.max_bytes, clock=clock
        )
    return RedisIdempotencyStore(
        redis,
        keys=keys,
        prefix=config.redis.prefix,
        clock=clock,
        integrity_failed=metrics.store_integrity_failures.labels("idempotency").inc,
    )
