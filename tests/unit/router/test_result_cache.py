"""Result cache core: the byte-bounded LRU with TTL, self-verifying entries, and when a request uses the
cache. Time is a plain float: nothing here sleeps."""

from __future__ import annotations

import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.errors import SluiceError
from sluice_inference.router.policy.result_cache import (
    ENTRY_OVERHEAD_BYTES,
    ByteLRU,
    CachedResult,
    CacheUse,
    Rejected,
    cache_use,
    decode_entry,
    encode_entry,
    purge_tag,
)
from sluice_inference.router.policy.sealing import SealKeys
from sluice_inference.router.stores.cache_store import ResultCacheStore

K = "k" * 64  # cache keys are 64 hex digits
ENTRY = len(K) + 100 + ENTRY_OVERHEAD_BYTES  # the charge for a 100-byte value under a 64-char key


KEYS = SealKeys([b"k" * 32])


def key(i: int) -> str:
    return f"{i:064d}"


# ---------------------------------------------------------------- ByteLRU


def test_bytes_used_never_exceeds_capacity_and_lru_is_evicted_first() -> None:
    lru = ByteLRU(capacity_bytes=3 * ENTRY, ttl_s=60)
    for i in range(3):
        assert lru.put(key(i), bytes(100), now=0)
    assert lru.bytes_used == 3 * ENTRY
    assert lru.get(key(0), now=1) is not None  # 0 is now the most recently used; 1 is the LRU
    lru.put(key(3), bytes(100), now=2)
    assert lru.bytes_used <= lru.capacity_bytes
    assert lru.get(key(1), now=2) is None
    assert all(lru.get(key(i), now=2) is not None for i in (0, 2, 3))
    assert lru.counters.evictions == 1


def test_a_large_value_evicts_as_many_entries_as_it_needs() -> None:
    lru = ByteLRU(capacity_bytes=4 * ENTRY, ttl_s=60)
    for i in range(4):
        lru.put(key(i), bytes(100), now=0)
    lru.put(key(9), bytes(ENTRY + 200), now=0)  # charged a little over two entries: three must go
    assert lru.bytes_used <= lru.capacity_bytes
    assert [lru.get(key(i), now=0) is not None for i in range(4)] == [False, False, False, True]
    assert lru.counters.evictions == 3


def test_a_value_larger_than_capacity_is_refused_and_evicts_nothing() -> None:
    lru = ByteLRU(capacity_bytes=2 * ENTRY, ttl_s=60)
    lru.put(key(0), bytes(100), now=0)
    assert not lru.put(key(1), bytes(2 * ENTRY), now=0)
    assert lru.counters.too_large == 1
    assert lru.get(key(0), now=0) is not None and len(lru) == 1


def test_replacing_a_key_recharges_its_size() -> None:
    lru = ByteLRU(capacity_bytes=10 * ENTRY, ttl_s=60)
    lru.put(K, bytes(100), now=0)
    lru.put(K, bytes(10), now=0)
    assert lru.bytes_used == len(K) + 10 + ENTRY_OVERHEAD_BYTES and len(lru) == 1


def test_entries_expire_at_their_ttl() -> None:
    lru = ByteLRU(capacity_bytes=10 * ENTRY, ttl_s=5)
    lru.put(K, b"v", now=100)
    assert lru.get(K, now=104.999) == b"v"
    assert lru.get(K, now=105) is None
    assert lru.counters.expired == 1 and lru.bytes_used == 0


def test_a_shorter_ttl_override_wins_but_never_a_longer_one() -> None:
    lru = ByteLRU(capacity_bytes=10 * ENTRY, ttl_s=5)
    lru.put(key(0), b"v", now=0, ttl_s=1)
    lru.put(key(1), b"v", now=0, ttl_s=50)
    assert lru.get(key(0), now=1) is None
    assert lru.get(key(1), now=4.9) == b"v" and lru.get(key(1), now=5) is None


def test_expired_entries_are_freed_before_live_ones_are_evicted() -> None:
    lru = ByteLRU(capacity_bytes=2 * ENTRY, ttl_s=10)
    lru.put(key(0), bytes(100), now=0)
    lru.put(key(1), bytes(100), now=8)
    lru.put(key(2), bytes(100), now=11)  # key 0 expired at 10: it goes, key 1 stays
    assert lru.get(key(1), now=11) is not None
    assert lru.counters.evictions == 0 and lru.counters.expired == 1


def test_purge_by_tag() -> None:
    lru = ByteLRU(capacity_bytes=10 * ENTRY, ttl_s=60)
    lru.put(key(0), b"a", now=0, tag=purge_tag("mlp", "1"))
    lru.put(key(1), b"b", now=0, tag=purge_tag("mlp", "2"))
    lru.put(key(2), b"c", now=0, tag=purge_tag("mlp2", "1"))
    assert lru.purge(lambda tag: tag == purge_tag("mlp", "1")) == 1
    prefix = purge_tag("mlp")
    assert lru.purge(lambda tag: tag.startswith(prefix)) == 1  # "mlp2" is not a version of "mlp"
    assert lru.get(key(2), now=0) == b"c" and len(lru) == 1


# ---------------------------------------------------------------- entries


def test_entry_round_trip() -> None:
    blob = encode_entry(K, b"response", "7", model="mlp", keys=KEYS)
    assert decode_entry(K, blob, keys=KEYS) == CachedResult(b"response", "mlp", "7")
    empty = encode_entry(K, b"", "", model="m", keys=KEYS)
    assert decode_entry(K, empty, keys=KEYS) == CachedResult(b"", "m", "")


def test_entry_under_another_key_is_rejected() -> None:
    blob = encode_entry(key(1), b"response", "7", model="mlp", keys=KEYS)
    assert decode_entry(key(2), blob, keys=KEYS) is Rejected.FORGED


@pytest.mark.parametrize("where", [5, 40, -1])
def test_a_corrupted_entry_is_rejected(where: int) -> None:
    blob = bytearray(encode_entry(K, b"response", "7", model="mlp", keys=KEYS))
    blob[where] ^= 0x01
    assert decode_entry(K, bytes(blob), keys=KEYS) is Rejected.FORGED


def test_truncated_and_garbage_entries_are_rejected() -> None:
    blob = encode_entry(K, b"response", "7", model="mlp", keys=KEYS)
    for bad in (b"", b"SLC3", blob[:30], b"x" * 100):
        assert decode_entry(K, bad, keys=KEYS) is Rejected.MALFORMED
    for damaged in (blob[:40], blob[:-1]):  # its own magic, but cut short: damaged or made by hand
        assert decode_entry(K, damaged, keys=KEYS) is Rejected.FORGED


def test_entries_of_older_formats_are_misses_but_not_forgeries() -> None:
    blob = encode_entry(K, b"response", "7", model="mlp", keys=KEYS)
    for magic in (b"SLC1", b"SLC2"):
        assert decode_entry(K, magic + blob[4:], keys=KEYS) is Rejected.OLD_FORMAT


def test_only_a_holder_of_the_key_can_make_an_entry() -> None:
    """The format-2 entry was a plain SHA-256 that anyone could recompute; now an entry made with any other
    key (or none) is a forgery, and a rotation's old key is accepted for reading only."""
    forged = encode_entry(K, b"planted", "7", model="mlp", keys=SealKeys([b"y" * 32]))
    assert decode_entry(K, forged, keys=KEYS) is Rejected.FORGED
    rotated = SealKeys([b"n" * 32, b"k" * 32])
    assert decode_entry(K, encode_entry(K, b"r", "7", model="mlp", keys=KEYS), keys=rotated) is not None
    assert (
        decode_entry(K, encode_entry(K, b"r", "7", model="mlp", keys=rotated), keys=KEYS) is Rejected.FORGED
    )
    with pytest.raises(ValueError):
        SealKeys([])


# ---------------------------------------------------------------- when the cache is used


def test_cache_use() -> None:
    assert cache_use(deterministic=True, enabled=True) is CacheUse.LOOKUP
    assert cache_use(deterministic=True, enabled=True, requested=True) is CacheUse.LOOKUP
    assert cache_use(deterministic=True, enabled=True, requested=False) is CacheUse.BYPASS
    assert cache_use(deterministic=False, enabled=True) is CacheUse.OFF
    assert cache_use(deterministic=True, enabled=False, requested=True) is CacheUse.OFF
    assert cache_use(deterministic=True, enabled=True, banned=True) is CacheUse.BYPASS
    assert cache_use(deterministic=False, enabled=True, banned=True) is CacheUse.OFF
    with pytest.raises(SluiceError) as caught:
        cache_use(deterministic=True, enabled=True, requested="false")
    assert caught.value.reason == "bad_parameter"


# ---------------------------------------------------------------- the store, memory tier only


async def test_store_without_redis_hits_misses_and_purges() -> None:
    clock = FakeClock()
    store = ResultCacheStore(capacity_bytes=10 * ENTRY, ttl_s=10, clock=clock)
    assert await store.get(K) is None
    await store.put(K, b"resp", model="mlp", model_version="1")
    assert await store.get(K) == CachedResult(b"resp", "mlp", "1")
    store.record_bypass()
    clock.advance(10)
    assert await store.get(K) is None
    await store.put(K, b"resp", model="mlp", model_version="1")
    assert (await store.purge_model("mlp", "2")).memory == 0
    assert (await store.purge_model("mlp")).memory == 1
    stats = store.stats
    assert (stats.hits, stats.misses, stats.bypasses, stats.puts) == (1, 2, 1, 2)
    assert (stats.expired, stats.purged, stats.entries, stats.bytes_used) == (1, 1, 0, 0)


def test_a_redis_tier_needs_the_clusters_key() -> None:
    with pytest.raises(ValueError, match="HMAC"):
        ResultCacheStore(capacity_bytes=ENTRY, ttl_s=10, redis=object())  # type: ignore[arg-type]
