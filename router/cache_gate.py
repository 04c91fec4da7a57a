"""The result cache around one inference call: key, lookup, coalesce misses, store.

Only models that declare `deterministic: true` and `cache: enabled` are cached; a request can bypass
with `parameters["cache"]=false`. Keys are digests over the tenant scope (unless the model is shared),
model, resolved version, model digest, canonical inputs, requested outputs and every parameter that can
change the output (`router/policy/cache_keys.py`). Cached values are results without anything that belongs
to one request (id, worker, batch size, queue time, cache outcome), in their stored form
(`router/stored_results.py`), so a hit answers with exactly the bytes of the miss that stored it.
Concurrent identical misses run once (`Coalescer`).

Every request the cache answers pays its tenant's rate limit like one that runs: a hit, and a caller that
joins another request's execution of the same key, take a token through `charge` (RESOURCE_EXHAUSTED when
the tenant has none), since neither passes through admission; the caller that executes pays there.

An audit that finds a wrong entry (`router/auditor.py` decides which hits are audited and how they are
judged) calls `quarantine`: the entry is removed from both tiers and counted against the tenant whose hit
it was; after `cache.audit_strikes` of them that tenant's requests to that model bypass the cache on this
router for `cache.audit_ban_s` (`Strikes`, router/policy/cache_audit.py). Other tenants keep their hits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping

from sluice_inference.common.records import ModelRecord
from sluice_inference.common.serving_settings import CacheSettings
from sluice_inference.router.calls import CacheOutcome, InferResult
from sluice_inference.router.codec import DecodedRequest
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.cache_audit import Strikes
from sluice_inference.router.policy.cache_keys import ParamValue, cache_key, cache_scope, tensors_from
from sluice_inference.router.policy.result_cache import CacheUse, cache_use
from sluice_inference.router.stored_results import decode_result, encode_result
from sluice_inference.router.stores.cache_store import ResultCacheStore
from sluice_inference.router.stores.coalescer import Coalescer

log = logging.getLogger(__name__)

Execute = Callable[[], Awaitable[InferResult]]
Charge = Callable[[], None]
"""Take one of the caller's tenant's rate tokens, or raise ResourceExhausted."""


@dataclasses.dataclass(frozen=True)
class Lookup:
    """How one request uses the cache, and under which key."""

    use: CacheUse
    key: str = ""


_KEYLESS = {use: Lookup(use) for use in CacheUse}
"""The lookups without a key, made once: most requests (a model that is not cacheable) get one."""


class CacheGate:
    """Decides, looks up, coalesces and stores."""

    def __init__(self, store: ResultCacheStore, settings: CacheSettings, metrics: RouterMetrics) -> None:
        self.store = store
        self._settings = settings
        self._metrics = metrics
        self._coalescer: Coalescer[InferResult] = Coalescer()
        self.strikes = Strikes(limit=settings.audit_strikes, ban_s=settings.audit_ban_s)

    def lookup(
        self, tenant: str, record: ModelRecord, decoded: DecodedRequest, parameters: Mapping[str, ParamValue]
    ) -> Lookup:
        """Whether (and under which key) this request uses the cache."""
        deterministic, enabled = record.deterministic, self._settings.enabled and record.cache
        # The strikes are asked only where they can matter: most models are not cacheable.
        banned = (
            deterministic and enabled and self.strikes.banned(tenant, record.name, self.store.clock.now())
        )
        use = cache_use(
            deterministic=deterministic, enabled=enabled, requested=parameters.get("cache"), banned=banned
        )
        if use is not CacheUse.LOOKUP:
            return _KEYLESS[use]
        key = cache_key(
            scope=cache_scope(tenant, shared=record.cache_scope == "shared"),
            model=record.name,
            version=record.version,
            model_digest=record.digest,
            inputs=tensors_from(decoded.inputs),
            outputs=decoded.outputs,
            parameters=parameters,
        )
        return Lookup(use, key)

    async def serve(
        self,
        lookup: Lookup,
        record: ModelRecord,
        decoded: DecodedRequest,
        execute: Execute,
        *,
        charge: Charge,
    ) -> InferResult:
        """The result, from the cache or from `execute`, with its cache outcome set (none when the model
        is not cacheable) and this request's id. A request answered without running `execute` itself
        first takes its rate token through `charge`."""
        model = record.name
        if lookup.use is CacheUse.OFF:
            return await execute()
        if lookup.use is CacheUse.BYPASS:
            self.store.record_bypass()
            self._metrics.cache.labels(model, "bypass").inc()
            return _marked(await execute(), CacheOutcome.BYPASS, decoded.client_id)
        hit = await self._hit(lookup.key, record, decoded.client_id)
        if hit is not None:
            charge()
            self._metrics.cache.labels(model, "hit").inc()
            return hit
        if self._coalescer.running(lookup.key):
            charge()  # served by another request's execution, which paid only for itself
        self._metrics.cache.labels(model, "miss").inc()

        async def execute_and_store() -> InferResult:
            result = await execute()
            stored = dataclasses.replace(result, served=None, cache=None)
            await self.store.put(
                lookup.key, encode_result(stored), model=model, model_version=result.model_version
            )
            return result

        shared = await self._coalescer.run(lookup.key, execute_and_store)
        return _marked(shared, CacheOutcome.MISS, decoded.client_id)

    async def _hit(self, key: str, record: ModelRecord, request_id: str) -> InferResult | None:
        cached = await self.store.get(key)
        if cached is None:
            return None
        try:
            result = decode_result(cached.result_bytes, request_id=request_id)
        except ValueError as exc:  # verified against its key, yet unreadable: a writer's bug; recompute
            log.error("cache entry of %s version %s is unreadable: %s", record.name, record.version, exc)
            return None
        return dataclasses.replace(result, cache=CacheOutcome.HIT)

    async def quarantine(self, key: str, tenant: str, model: str) -> bool:
        """An audit found the entry under `key`, hit by `tenant`, wrong: remove it from both tiers and
        count it against the tenant; whether the tenant's requests to `model` now bypass the cache."""
        await self.store.discard(key)
        return self.strikes.strike(tenant, model, self.store.clock.now())


def _marked(result: InferResult, how: CacheOutcome, request_id: str) -> InferResult:
    """This caller's copy: its own id and the cache outcome (coalesced callers share one execution)."""
    return dataclasses.replace(result, id=request_id, cache=how)
