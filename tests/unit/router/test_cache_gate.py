"""The cache gate on its own: one execution per set of identical misses, entries that hold nothing of one
request, bypass, quarantined entries and tenants, every answer from the cache paying the tenant's rate,
and an unreadable entry recomputed rather than served."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.errors import ResourceExhausted
from sluice_inference.common.serving_settings import (
    AdmissionSettings,
    CacheSettings,
    RouterSettings,
    TenantSettings,
)
from sluice_inference.router.cache_gate import CacheGate, Lookup
from sluice_inference.router.calls import CacheOutcome, InferResult, ServedBy, Tensor
from sluice_inference.router.codec import DecodedRequest, decode_call
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.core import RouterCore
from sluice_inference.router.policy.result_cache import CacheUse
from sluice_inference.router.stored_results import decode_result
from sluice_inference.router.stores.cache_store import ResultCacheStore
from tests.support.dataplane import GOLD_KEY, make_plane, mlp, raw_call

RECORD = mlp("1")
Y = Tensor("y", "FP32", (1, 4), np.arange(4, dtype="<f4").reshape(1, 4).tobytes())


def gate(settings: CacheSettings | None = None) -> CacheGate:
    store = ResultCacheStore(capacity_bytes=1024 * 1024, ttl_s=60.0, clock=FakeClock())
    return CacheGate(store, settings or CacheSettings(), RouterMetrics())


class Charges:
    """A `Charge` that counts, and refuses once `tokens` are spent (like an empty token bucket)."""

    def __init__(self, tokens: int = 10**6) -> None:
        self.taken = 0
        self.tokens = tokens

    def __call__(self) -> None:
        if self.taken >= self.tokens:
            raise ResourceExhausted("tenant 'gold' is over its rate", reason="tenant_rate", retry_after_s=1.0)
        self.taken += 1


CHARGES = Charges()


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
    pending = [
        asyncio.create_task(cache.serve(lookup(cache, d), RECORD, d, execute, charge=CHARGES)) for d in (a, b)
    ]
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
    await cache.serve(lookup(cache, request), RECORD, request, execute, charge=CHARGES)
    entry = await cache.store.get(key)
    assert entry is not None
    stored = decode_result(entry.result_bytes, request_id="x")
    assert (stored.outputs, stored.served, stored.cache, stored.model_version) == ((Y,), None, None, "1")
    hit = await cache.serve(lookup(cache, request), RECORD, decoded("later"), execute, charge=CHARGES)
    assert (hit.id, hit.cache, hit.served, hit.outputs) == ("later", CacheOutcome.HIT, None, (Y,))
    assert execute.runs == 1


async def test_a_bypass_neither_reads_nor_writes() -> None:
    cache, execute = gate(), Executions()
    request = decoded(cache=False)
    bypass = lookup(cache, request, cache=False)
    assert bypass.use is CacheUse.BYPASS
    result = await cache.serve(bypass, RECORD, request, execute, charge=CHARGES)
    assert result.cache is CacheOutcome.BYPASS and result.served is not None
    assert cache.store.stats.puts == 0 and cache.store.stats.bypasses == 1


async def test_a_quarantined_entry_is_gone_and_repeated_strikes_ban_only_that_tenant() -> None:
    cache, execute = gate(CacheSettings(audit_strikes=2, audit_ban_s=60.0)), Executions()
    request = decoded()
    mine = lookup(cache, request)
    await cache.serve(mine, RECORD, request, execute, charge=CHARGES)
    assert not await cache.quarantine(mine.key, "gold", "mlp")  # one strike: the entry goes, no ban
    assert await cache.store.get(mine.key) is None
    assert lookup(cache, request).use is CacheUse.LOOKUP
    assert await cache.quarantine(mine.key, "gold", "mlp")  # the second within audit_ban_s: banned
    assert lookup(cache, request).use is CacheUse.BYPASS
    theirs = cache.lookup("silver", RECORD, request, {})
    assert theirs.use is CacheUse.LOOKUP  # other tenants keep their cache
    clock = cache.store.clock
    assert isinstance(clock, FakeClock)
    clock.advance(61.0)
    assert lookup(cache, request).use is CacheUse.LOOKUP  # a ban ends


async def test_every_answer_from_the_cache_pays_the_tenants_rate() -> None:
    """A hit and a caller that joins another's execution take a token; the executing caller pays at
    admission instead (its `execute`), so each request pays exactly once."""
    cache, execute, charges = gate(), Executions(), Charges(tokens=2)
    execute.release.clear()
    a, b = decoded("a"), decoded("b")
    pending = [
        asyncio.create_task(cache.serve(lookup(cache, d), RECORD, d, execute, charge=charges)) for d in (a, b)
    ]
    for _ in range(100):
        if execute.runs:
            break
        await asyncio.sleep(0)
    execute.release.set()
    await asyncio.gather(*pending)
    assert (execute.runs, charges.taken) == (1, 1)  # the leader ran; the follower paid
    hit = await cache.serve(lookup(cache, a), RECORD, decoded("c"), execute, charge=charges)
    assert hit.cache is CacheOutcome.HIT and charges.taken == 2
    with pytest.raises(ResourceExhausted):  # out of tokens: a hit is refused like a miss would be
        await cache.serve(lookup(cache, a), RECORD, decoded("d"), execute, charge=charges)
    assert execute.runs == 1


async def test_an_unreadable_entry_is_recomputed_and_replaced() -> None:
    cache, execute = gate(), Executions()
    request = decoded()
    key = lookup(cache, request).key
    await cache.store.put(key, b"\xff\xff not a stored result", model="mlp", model_version="1")
    first = await cache.serve(lookup(cache, request), RECORD, request, execute, charge=CHARGES)
    second = await cache.serve(lookup(cache, request), RECORD, request, execute, charge=CHARGES)
    assert (first.cache, second.cache, execute.runs) == (CacheOutcome.MISS, CacheOutcome.HIT, 1)


# ---------------------------------------------------------------- answers from the cache pay the rate


async def test_a_hit_through_the_data_plane_takes_the_tenants_rate_token() -> None:
    made = make_plane()
    call = raw_call([1.0, 2.0, 3.0, 4.0], api_key=GOLD_KEY)
    miss = await made.plane.infer(call)
    assert miss.cache is CacheOutcome.MISS and made.backend.charged == []  # paid at admission
    hit = await made.plane.infer(call)
    assert hit.cache is CacheOutcome.HIT and made.backend.charged == ["gold"]
    made.backend.charge_errors.append(
        ResourceExhausted("tenant 'gold' is over its rate", reason="tenant_rate", retry_after_s=0.5)
    )
    with pytest.raises(ResourceExhausted):  # a tenant out of tokens is not served from the cache either
        await made.plane.infer(call)
    assert len(made.backend.calls) == 1


def test_the_core_charges_a_hit_to_the_tenants_bucket_without_an_inflight_slot() -> None:
    admission = AdmissionSettings(estimate_margin=1.0)
    core = RouterCore(
        0.0,
        settings=RouterSettings(),
        admission=admission,
        tenants={"gold": TenantSettings(rate=1.0, burst=2)},
    )
    core.charge(0.0, "gold")
    core.charge(0.0, "gold")
    with pytest.raises(ResourceExhausted) as caught:
        core.charge(0.0, "gold")
    assert caught.value.reason == "tenant_rate" and caught.value.retry_after_s == pytest.approx(1.0)
    assert core.admission.limiter.inflight["gold"] == 0  # a hit holds no in-flight slot
    core.charge(1.0, "gold")  # refilled at the tenant's rate
