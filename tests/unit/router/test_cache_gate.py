"""The cache gate on its own: one execution per set of identical misses, entries that hold nothing of one
request, bypass and disabled digests, and an unreadable entry recomputed rather than served."""

from __future__ import annotations

import asyncio

import numpy as np

from common.clock import FakeClock
from common.config import CacheSettings
from router.cache_gate import CacheGate, Lookup
from router.calls import CacheOutcome, InferResult, ServedBy, Tensor
from router.codec import DecodedRequest, decode_call
from router.metrics import RouterMetrics
from router.policy.result_cache import CacheUse
from router.stored_results import decode_result
from router.stores.cache_store import ResultCacheStore
from tests.support.dataplane import mlp, raw_call

RECORD = mlp("1")
Y = Tensor("y", "FP32", (1, 4), np.arange(4, dtype="<f4").reshape(1, 4).tobytes())


def gate() -> CacheGate:
    store = ResultCacheStore(capacity_bytes=1024 * 1024, ttl_s=60.0, clock=FakeClock())
    return CacheGate(store, CacheSettings(), RouterMetrics())


def decoded(request_id: str = "r", **parameters: bool) -> DecodedRequest:
    return decode_call(raw_call([1.0, 2.0, 3.0, 4.0], id=request_id, parameters=parameters), RECORD)


def lookup(gate: CacheGate, request: DecodedRequest, **parameters: bool) -> Lookup:
    return gate.lookup("gold", RECORD, request, parameters)


class Executions:
    """An `Execute` that counts its runs and can be held until released."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self) -> InferResult:
        self.runs += 1
        await self.release.wait()
        return InferResult("mlp", "1", "owner", (Y,), ServedBy("w1", 3, 0.01))


async def test_identical_concurrent_misses_run_once_and_each_caller_keeps_its_own_id() -> None:
    cache, execute = gate(), Executions()
    execute.release.clear()
    a, b = decoded("a"), decoded("b")
    pending = [asyncio.create_task(cache.serve(lookup(cache, d), RECORD, d, execute)) for d in (a, b)]
    for _ in range(100):  # bounded: both callers are in before the one execution starts
        if execute.runs:
            break
        await asyncio.sleep(0)
    execute.release.set()
    results = await asyncio.gather(*pending)
    assert execute.runs == 1
    assert [(r.id, r.cache) for r in results] == [("a", CacheOutcome.MISS), ("b", CacheOutcome.MISS)]
    assert results[0].outputs == results[1].outputs == (Y,)


async def test_a_stored_entry_holds_the_outputs_and_nothing_of_the_request_that_stored_it() -> None:
    cache, execute = gate(), Executions()
    request = decoded()
    key = lookup(cache, request).key
    await cache.serve(lookup(cache, request), RECORD, request, execute)
    entry = await cache.store.get(key)
    assert entry is not None
    stored = decode_result(entry.result_bytes, request_id="x")
    assert (stored.outputs, stored.served, stored.cache, stored.model_version) == ((Y,), None, None, "1")
    hit = await cache.serve(lookup(cache, request), RECORD, decoded("later"), execute)
    assert (hit.id, hit.cache, hit.served, hit.outputs) == ("later", CacheOutcome.HIT, None, (Y,))
    assert execute.runs == 1


async def test_a_bypass_neither_reads_nor_writes() -> None:
    cache, execute = gate(), Executions()
    request = decoded(cache=False)
    bypass = lookup(cache, request, cache=False)
    assert bypass.use is CacheUse.BYPASS
    result = await cache.serve(bypass, RECORD, request, execute)
    assert result.cache is CacheOutcome.BYPASS and result.served is not None
    assert cache.store.stats.puts == 0 and cache.store.stats.bypasses == 1


async def test_a_disabled_digest_is_not_cached_and_never_served_from_an_entry_it_left() -> None:
    cache, execute = gate(), Executions()
    request = decoded()
    earlier = lookup(cache, request)
    await cache.serve(earlier, RECORD, request, execute)
    cache.disable(RECORD.digest)
    assert lookup(cache, request).use is CacheUse.OFF
    again = await cache.serve(earlier, RECORD, request, execute)  # looked up before the audit failed
    assert again.cache is CacheOutcome.MISS and execute.runs == 2


async def test_an_unreadable_entry_is_recomputed_and_replaced() -> None:
    cache, execute = gate(), Executions()
    request = decoded()
    key = lookup(cache, request).key
    await cache.store.put(key, b"\xff\xff not a stored result", model="mlp", model_version="1")
    first = await cache.serve(lookup(cache, request), RECORD, request, execute)
    second = await cache.serve(lookup(cache, request), RECORD, request, execute)
    assert (first.cache, second.cache, execute.runs) == (CacheOutcome.MISS, CacheOutcome.HIT, 1)
