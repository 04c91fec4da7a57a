"""The stores against a real Valkey: shared idempotency across routers, the two-tier cache, outages,
privacy (the coalescer needs no Redis: tests/unit/router/test_coalescer.py).

Two `open_redis` clients (two connection pools) stand for two routers. Each test gets its own server
(≈ 50 ms to start), so stopping, pausing or restarting it cannot disturb another test; every wait is
bounded, and teardown closes every store and client and stops the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice_inference.common.clock import MonotonicClock
from sluice_inference.common.errors import Code, SluiceError
from sluice_inference.router.policy.cache_keys import TensorBytes, cache_key, cache_scope, request_fingerprint
from sluice_inference.router.policy.idempotency import (
    Conflict,
    Proceed,
    Record,
    Replay,
    State,
    StoredError,
    StoredSuccess,
    Wait,
    scoped_key,
)
from sluice_inference.router.policy.idempotency_records import encode_record
from sluice_inference.router.policy.result_cache import CachedResult, encode_entry
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.router.stores.idempotency_store import acquire
from sluice_inference.router.stores.redis_conn import RedisOptions, open_redis
from sluice_inference.router.stores.redis_idempotency import RedisIdempotencyStore
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

CLOCK = MonotonicClock()
RAW_MARKER = b"RAW-INPUT-MARKER-\x00\x01\x02-do-not-leak"
RAW_KEY = "client-idempotency-key-DO-NOT-LEAK"
OUTPUT = b"model-output-bytes"
MB = 1 << 20
KEYS = SealKeys([b"cluster-hmac-key-for-these-tests!"])
ATTACKER = SealKeys([b"a-key-the-routers-have-never-seen"])
PLANTED = b"planted-result-bytes"


class Routers:
    """Makes per-"router" clients and stores (sharing the cluster's HMAC key), counts the integrity
    failures they report, and closes all of them at teardown."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.clients: list[Redis] = []
        self.idem_stores: list[RedisIdempotencyStore] = []
        self.integrity_failures: list[str] = []

    def client(self) -> Redis:
        client = open_redis(RedisOptions(url=self.server.url))
        self.clients.append(client)
        return client

    def idempotency(self, **kwargs: Any) -> RedisIdempotencyStore:
        store = RedisIdempotencyStore(
            self.client(),
            keys=KEYS,
            down_backoff_s=0.2,
            integrity_failed=lambda: self.integrity_failures.append("idempotency"),
            **kwargs,
        )
        self.idem_stores.append(store)
        return store

    def cache(self, **kwargs: Any) -> ResultCacheStore:
        return ResultCacheStore(
            capacity_bytes=MB,
            ttl_s=60,
            redis=self.client(),
            keys=KEYS,
            down_backoff_s=0.2,
            integrity_failed=lambda: self.integrity_failures.append("cache"),
            **kwargs,
        )

    async def close(self) -> None:
        for store in self.idem_stores:
            await store.close()
        for client in self.clients:
            await client.aclose()


@pytest.fixture
async def routers(redis_server: RedisServer) -> AsyncIterator[Routers]:
    made = Routers(redis_server)
    try:
        yield made
    finally:
        await made.close()


def inputs(marker: bytes = RAW_MARKER) -> tuple[TensorBytes, ...]:
    return (TensorBytes("x", "UINT8", (1, len(marker)), marker),)


def key_for(tenant: str, *, model: str = "mlp", version: str = "1") -> str:
    return cache_key(
        scope=cache_scope(tenant, shared=False),
        model=model,
        version=version,
        model_digest="sha256:d1",
        inputs=inputs(),
        outputs=("y",),
        parameters={},
    )


FP = request_fingerprint(model="mlp", requested_version="", inputs=inputs(), outputs=(), parameters={})
SK = scoped_key("gold", RAW_KEY)
OK = StoredSuccess(OUTPUT, "1")


async def within(seconds: float, awaitable: Any) -> tuple[Any, float]:
    start = time.monotonic()
    result = await asyncio.wait_for(awaitable, seconds)
    return result, time.monotonic() - start


# ---------------------------------------------------------------- idempotency across routers


async def test_fifty_concurrent_claims_from_two_routers(routers: Routers) -> None:
    # recheck_s is long, so waking within it proves the publish reached both routers' subscribers.
    stores = [routers.idempotency(recheck_s=10), routers.idempotency(recheck_s=10)]
    claims = await asyncio.gather(*(stores[i % 2].claim(SK, FP, lease_s=30) for i in range(50)))
    owners = [c for c in claims if isinstance(c, Proceed)]
    assert len(owners) == 1
    assert sum(isinstance(c, Wait) for c in claims) == 49
    waiters = [asyncio.create_task(stores[i % 2].wait(SK, FP, timeout_s=5)) for i in range(49)]
    await asyncio.sleep(0.2)  # let every waiter subscribe and find the record in flight
    assert not any(w.done() for w in waiters)
    assert await stores[0].complete(owners[0].ticket, OK)
    outcomes, took = await within(2, asyncio.gather(*waiters))
    assert outcomes == [OK] * 49 and took < 1.0
    later = await asyncio.gather(*(s.claim(SK, FP, lease_s=30) for s in stores))
    assert later == [Replay(OK), Replay(OK)]


async def test_waiters_on_many_keys_share_one_subscriber(routers: Routers) -> None:
    owner_store, waiter_store = routers.idempotency(), routers.idempotency(recheck_s=10)
    keys = [scoped_key("gold", f"key-{i}") for i in range(20)]
    owners = await asyncio.gather(*(owner_store.claim(k, FP, lease_s=30) for k in keys))
    waiters = [asyncio.create_task(waiter_store.wait(k, FP, timeout_s=5)) for k in keys for _ in range(2)]
    await asyncio.sleep(0.1)
    for owner in owners:
        assert isinstance(owner, Proceed)
        await owner_store.complete(owner.ticket, StoredSuccess(owner.ticket.scoped_key.encode(), "1"))
    outcomes, took = await within(2, asyncio.gather(*waiters))
    assert [o.result_bytes.decode() for o in outcomes] == [k for k in keys for _ in range(2)]
    assert took < 1.0


async def test_conflict_on_a_different_fingerprint(routers: Routers) -> None:
    a, b = routers.idempotency(), routers.idempotency()
    owner = await a.claim(SK, FP, lease_s=30)
    assert isinstance(owner, Proceed)
    assert await b.claim(SK, "another-fingerprint", lease_s=30) == Conflict()
    await a.complete(owner.ticket, OK)
    with pytest.raises(SluiceError) as caught:
        await acquire(b, SK, "another-fingerprint", lease_s=30, wait_s=1, clock=CLOCK)
    assert caught.value.code == Code.FAILED_PRECONDITION


async def test_release_lets_a_waiter_on_another_router_proceed(routers: Routers) -> None:
    a, b = routers.idempotency(), routers.idempotency(recheck_s=10)
    owner = await a.claim(SK, FP, lease_s=30)
    assert isinstance(owner, Proceed)
    waiter = asyncio.create_task(acquire(b, SK, FP, lease_s=30, wait_s=5, clock=CLOCK))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    assert await a.release(owner.ticket)
    took_over, took = await within(2, waiter)
    assert isinstance(took_over, Proceed) and took < 1.0
    assert not await a.release(owner.ticket)  # the old owner cannot free the new claim


async def test_a_dead_owners_claim_expires_with_its_lease(routers: Routers) -> None:
    a, b = routers.idempotency(), routers.idempotency(recheck_s=0.05)
    assert isinstance(await a.claim(SK, FP, lease_s=0.3), Proceed)  # ... and the owner dies
    took_over, took = await within(2, acquire(b, SK, FP, lease_s=30, wait_s=5, clock=CLOCK))
    assert isinstance(took_over, Proceed) and 0.2 < took < 1.0


async def test_terminal_errors_replay_across_routers(routers: Routers) -> None:
    a, b = routers.idempotency(), routers.idempotency()
    owner = await a.claim(SK, FP, lease_s=30)
    assert isinstance(owner, Proceed)
    error = StoredError(int(Code.INVALID_ARGUMENT), "input 'x': bad shape")
    assert await a.complete(owner.ticket, error)
    assert await b.claim(SK, FP, lease_s=30) == Replay(error)


async def test_idempotency_is_per_tenant(routers: Routers) -> None:
    a, b = routers.idempotency(), routers.idempotency()
    gold, silver = scoped_key("gold", RAW_KEY), scoped_key("silver", RAW_KEY)
    owner = await a.claim(gold, FP, lease_s=30)
    assert isinstance(owner, Proceed)
    await a.complete(owner.ticket, OK)
    assert isinstance(await b.claim(silver, FP, lease_s=30), Proceed)
    assert await b.claim(gold, FP, lease_s=30) == Replay(OK)


# ---------------------------------------------------------------- the two-tier cache


async def test_a_result_put_by_one_router_is_a_hit_on_another(routers: Routers) -> None:
    a, b = routers.cache(), routers.cache()
    key = key_for("gold")
    assert await b.get(key) is None
    await a.put(key, OUTPUT, model="mlp", model_version="1")
    expected = CachedResult(OUTPUT, "mlp", "1")
    assert await b.get(key) == expected  # from Redis, promoted
    assert await b.get(key) == expected  # from memory
    assert (b.stats.hits_redis, b.stats.hits_memory, b.stats.misses) == (1, 1, 1)


async def test_cache_is_per_tenant(routers: Routers) -> None:
    a, b = routers.cache(), routers.cache()
    await a.put(key_for("gold"), OUTPUT, model="mlp", model_version="1")
    assert key_for("gold") != key_for("silver")
    assert await a.get(key_for("silver")) is None
    assert await b.get(key_for("silver")) is None
    assert await b.get(key_for("gold")) is not None


async def test_redis_values_under_the_wrong_key_or_corrupted_are_misses(routers: Routers) -> None:
    a, b = routers.cache(), routers.cache()
    k1, k2 = key_for("gold"), key_for("gold", version="2")
    await a.put(k1, OUTPUT, model="mlp", model_version="1")
    redis = routers.client()
    good = await redis.get(f"sluice:cache:{k1}")
    assert isinstance(good, bytes)
    await redis.set(f"sluice:cache:{k2}", good)  # a value copied under another key
    assert await b.get(k2) is None
    await redis.set(f"sluice:cache:{k1}", good[:-1] + bytes([good[-1] ^ 1]))
    assert await b.get(k1) is None
    assert b.stats.rejected == 2 and b.stats.hits == 0
    assert b.stats.integrity_failures == 2 and routers.integrity_failures == ["cache", "cache"]


def _format_2_entry(key: str, result: bytes) -> bytes:
    """A cache entry as format 2 stored it: under a plain SHA-256 that anyone can compute."""
    parts = (b"sluice/cache-entry/2", key.encode(), b"mlp", b"1", result)
    digest = hashlib.sha256(b"".join(struct.pack(">Q", len(p)) + p for p in parts)).digest()
    return b"SLC2" + digest + b"\x00\x03mlp\x00\x011" + result


async def test_forged_and_corrupt_cache_entries_written_into_redis_are_counted_misses(
    routers: Routers,
) -> None:
    """Someone who can write to Redis but lacks the cluster's HMAC key cannot plant a result: not in the
    unkeyed format 2, not in format 3 under another key; a corrupted entry is not served either."""
    a, b = routers.cache(), routers.cache()
    redis = routers.client()
    forged_2, forged_3, corrupt = key_for("gold"), key_for("gold", version="2"), key_for("gold", version="3")
    await redis.set(f"sluice:cache:{forged_2}", _format_2_entry(forged_2, PLANTED))
    planted = encode_entry(forged_3, PLANTED, "2", model="mlp", keys=ATTACKER)
    await redis.set(f"sluice:cache:{forged_3}", planted)
    await a.put(corrupt, OUTPUT, model="mlp", model_version="3")
    good = await redis.get(f"sluice:cache:{corrupt}")
    assert isinstance(good, bytes)
    await redis.set(f"sluice:cache:{corrupt}", good.replace(OUTPUT, b"X" + OUTPUT[1:]))
    for key in (forged_2, forged_3, corrupt):
        assert await b.get(key) is None
    stats = b.stats
    assert (stats.hits, stats.misses, stats.rejected, stats.integrity_failures) == (0, 3, 3, 2)
    assert routers.integrity_failures == ["cache", "cache"]  # format 2 is an older router's: a plain miss
    await b.put(forged_3, OUTPUT, model="mlp", model_version="2")  # the next put replaces a forgery
    assert await a.get(forged_3) == CachedResult(OUTPUT, "mlp", "2")


def _format_2_record(outcome: bytes) -> bytes:
    """A completed idempotency record as format 2 stored it (no seal)."""
    return b"SLI2D" + b"\x00" + bytes([len(FP)]) + FP.encode() + b"\x00\x03tok" + b"R\x00\x011" + outcome


async def test_forged_and_corrupt_idempotency_records_written_into_redis_are_never_replayed(
    routers: Routers,
) -> None:
    """A record sealed with another key, or corrupted, is treated as absent (counted) and the claim
    replaces it; an unsealed record of format 2 is refused (fail closed), never replayed."""
    store = routers.idempotency()
    redis = routers.client()
    planted = Record(FP, State.COMPLETED, "attacker", StoredSuccess(PLANTED, "1"), 0.0)
    forged_key, corrupt_key, old_key = (scoped_key("gold", f"{RAW_KEY}-{i}") for i in range(3))
    await redis.set(
        store.record_key(forged_key), encode_record(planted, scoped_key=forged_key, keys=ATTACKER)
    )
    genuine = await store.claim(corrupt_key, FP, lease_s=30)
    assert isinstance(genuine, Proceed) and await store.complete(genuine.ticket, OK)
    sealed = await redis.get(store.record_key(corrupt_key))
    assert isinstance(sealed, bytes)
    await redis.set(store.record_key(corrupt_key), sealed.replace(OUTPUT, b"X" + OUTPUT[1:]))
    for key in (forged_key, corrupt_key):
        claimed = await store.claim(key, FP, lease_s=30)
        assert isinstance(claimed, Proceed), claimed  # a miss: this caller executes
        assert await store.complete(claimed.ticket, OK)
        assert await routers.idempotency().claim(key, FP, lease_s=30) == Replay(OK)  # its own outcome now
    assert store.stats.integrity_failures == 2
    assert routers.integrity_failures == ["idempotency", "idempotency"]
    await redis.set(store.record_key(old_key), _format_2_record(PLANTED))
    with pytest.raises(SluiceError) as caught:
        await store.claim(old_key, FP, lease_s=30)
    assert caught.value.code == Code.UNAVAILABLE and caught.value.reason == "idempotency_record_unreadable"


async def test_purge_model_and_version(routers: Routers) -> None:
    a, b = routers.cache(), routers.cache()
    entries = {
        ("mlp", "1"): key_for("gold", version="1"),
        ("mlp", "2"): key_for("gold", version="2"),
        ("enc", "1"): key_for("gold", model="enc"),
    }
    for (model, version), key in entries.items():
        await a.put(key, OUTPUT, model=model, model_version=version)
    purged = await a.purge_model("mlp", "1")
    assert (purged.memory, purged.redis) == (1, 1)
    assert await b.get(entries["mlp", "1"]) is None
    assert await b.get(entries["mlp", "2"]) is not None
    purged = await a.purge_model("mlp")
    assert (purged.memory, purged.redis) == (1, 1)
    assert await a.get(entries["mlp", "2"]) is None
    assert await routers.client().get(f"sluice:cache:{entries['mlp', '2']}") is None
    assert await b.get(entries["enc", "1"]) is not None


# ---------------------------------------------------------------- outages


async def test_redis_stopped_mid_run(
    routers: Routers, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice_inference.router.stores.redis_conn")
    idem, cache = routers.idempotency(), routers.cache()
    owner = await idem.claim(SK, FP, lease_s=30)
    assert isinstance(owner, Proceed)
    waiter = asyncio.create_task(idem.wait(SK, FP, timeout_s=10))
    await asyncio.sleep(0.1)
    redis_server.stop()
    with pytest.raises(SluiceError) as caught:
        await within(1.0, waiter)
    assert caught.value.reason == "idempotency_store_down"
    for _ in range(3):  # first attempt meets the dead server, later ones the back-off: all quick
        start = time.monotonic()
        with pytest.raises(SluiceError) as caught:
            await idem.claim(scoped_key("gold", "other"), FP, lease_s=30)
        assert time.monotonic() - start < 1.0
        assert caught.value.code == Code.UNAVAILABLE and caught.value.reason == "idempotency_store_down"
        assert caught.value.retry_after_s is not None and caught.value.retry_after_s > 0
        assert (await within(1.0, cache.get(key_for("gold"))))[0] is None
    await within(1.0, cache.put(key_for("gold"), OUTPUT, model="mlp", model_version="1"))
    assert not await idem.complete(owner.ticket, OK)  # never raises
    assert idem.outage.down and cache.stats.redis_down
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("sluice_inference.router")
    ]
    assert len(warnings) == 2, warnings  # once per store for the whole outage, not once per call
    redis_server.start()
    await _eventually_claims(idem)
    assert not idem.outage.down


async def test_redis_hung_costs_bounded_time(routers: Routers, redis_server: RedisServer) -> None:
    idem, cache = routers.idempotency(), routers.cache()
    await idem.claim(scoped_key("gold", "warm-up"), FP, lease_s=30)
    redis_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(SluiceError) as caught:
            await idem.claim(SK, FP, lease_s=30)
        assert caught.value.reason == "idempotency_store_down"
        assert time.monotonic() - start < 1.0
        _, took = await within(2.0, cache.get(key_for("gold")))
        assert took < 1.0
    finally:
        redis_server.resume()
    await _eventually_claims(idem)


async def _eventually_claims(store: RedisIdempotencyStore) -> None:
    deadline = time.monotonic() + 5
    while True:
        try:
            await store.claim(scoped_key("gold", f"probe-{time.monotonic()}"), FP, lease_s=30)
            return
        except SluiceError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------- privacy


async def _dump(redis: Redis) -> dict[bytes, list[bytes]]:
    """Every key with every byte string stored under it."""
    dump: dict[bytes, list[bytes]] = {}
    async for key in redis.scan_iter(count=1000):
        kind: Any = await redis.type(key)
        values: Any
        if kind == b"string":
            values = [await redis.get(key)]
        elif kind == b"zset":
            values = await redis.zrange(key, 0, -1)
        else:
            raise AssertionError(f"unexpected {kind!r} at {key!r}: extend this check")
        dump[key] = list(values)
    return dump


async def test_redis_holds_no_raw_inputs_keys_or_tenant_names(routers: Routers) -> None:
    idem, cache = routers.idempotency(), routers.cache()
    await cache.put(key_for("gold"), OUTPUT, model="mlp", model_version="1")
    done = await idem.claim(SK, FP, lease_s=30)
    assert isinstance(done, Proceed)
    await idem.complete(done.ticket, OK)
    assert isinstance(await idem.claim(scoped_key("gold", RAW_KEY + "-2"), FP, lease_s=30), Proceed)
    dump = await _dump(routers.client())
    assert len(dump) == 4  # cache entry, cache index, two idempotency records
    for key, values in dump.items():
        for secret in (RAW_MARKER, RAW_KEY.encode(), b"gold"):
            assert secret not in key, (secret, key)
            assert not any(secret in value for value in values), (secret, key)
        assert b"mlp" not in key  # model names appear in cache values only (as in the response itself)
    assert any(OUTPUT in value for values in dump.values() for value in values)  # outputs are fine
