"""The result cache around one inference call: key, lookup, coalesce misses, store, audit.

Only models that declare `deterministic: true` and `cache: enabled` are cached; a request can bypass
with `parameters["cache"]=false`. Keys are digests over the tenant scope (unless the model is shared),
model, resolved version, model digest, canonical inputs, requested outputs and every parameter that can
change the output (`router/policy/cache_keys.py`). Cached values are responses stripped of per-request
fields (id, batch size, queue time, worker). Concurrent identical misses run once (`Coalescer`). A digest
whose audit failed is never served from the cache again by this router.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from common.config import CacheSettings
from common.pb.inference import grpc_service_pb2 as kserve
from common.records import ModelRecord
from router.codec import DecodedRequest, ParamValue
from router.metrics import RouterMetrics
from router.policy.cache_keys import cache_key, cache_scope, tensors_from
from router.policy.result_cache import CacheUse, cache_use
from router.stores.cache_store import ResultCacheStore
from router.stores.coalescer import Coalescer

log = logging.getLogger(__name__)

PER_REQUEST_PARAMETERS = ("sluice_batch_size", "sluice_queue_us", "sluice_worker", "sluice_cache")
Execute = Callable[[], Awaitable[kserve.ModelInferResponse]]
OnHit = Callable[[ModelRecord, DecodedRequest, kserve.ModelInferResponse], None]


@dataclass(frozen=True)
class Lookup:
    """How one request uses the cache, and under which key."""

    use: CacheUse
    key: str = ""


class CacheGate:
    """Decides, looks up, coalesces and stores; reports hits to the auditor."""

    def __init__(self, store: ResultCacheStore, settings: CacheSettings, metrics: RouterMetrics) -> None:
        self.store = store
        self._settings = settings
        self._metrics = metrics
        self._coalescer: Coalescer[kserve.ModelInferResponse] = Coalescer()
        self.disabled_digests: set[str] = set()
        self.on_hit: OnHit | None = None

    def lookup(
        self, tenant: str, record: ModelRecord, decoded: DecodedRequest, parameters: Mapping[str, ParamValue]
    ) -> Lookup:
        """Whether (and under which key) this request uses the cache."""
        enabled = self._settings.enabled and record.cache and record.digest not in self.disabled_digests
        use = cache_use(
            deterministic=record.deterministic, enabled=enabled, requested=parameters.get("cache")
        )
        if use is not CacheUse.LOOKUP:
            return Lookup(use)
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
        self, lookup: Lookup, record: ModelRecord, decoded: DecodedRequest, execute: Execute
    ) -> kserve.ModelInferResponse:
        """The response, from the cache or from `execute`, with `sluice_cache` set."""
        model = record.name
        if lookup.use is CacheUse.OFF:
            return await execute()
        if lookup.use is CacheUse.BYPASS:
            self.store.record_bypass()
            self._metrics.cache.labels(model, "bypass").inc()
            return _marked(await execute(), "bypass", decoded.client_id)
        cached = await self.store.get(lookup.key)
        if cached is not None and record.digest not in self.disabled_digests:
            self._metrics.cache.labels(model, "hit").inc()
            response = _marked(
                kserve.ModelInferResponse.FromString(cached.response_bytes), "hit", decoded.client_id
            )
            if self.on_hit is not None:
                self.on_hit(record, decoded, response)
            return response
        self._metrics.cache.labels(model, "miss").inc()

        async def execute_and_store() -> kserve.ModelInferResponse:
            response = await execute()
            stored = _stripped(response)
            await self.store.put(
                lookup.key, stored.SerializeToString(), model=model, model_version=response.model_version
            )
            return response

        shared = await self._coalescer.run(lookup.key, execute_and_store)
        return _marked(shared, "miss", decoded.client_id)

    def disable(self, digest: str) -> None:
        """Never serve this model digest from the cache again (an audit found a wrong entry)."""
        self.disabled_digests.add(digest)


def _stripped(response: kserve.ModelInferResponse) -> kserve.ModelInferResponse:
    stored = kserve.ModelInferResponse()
    stored.CopyFrom(response)
    stored.id = ""
    for name in PER_REQUEST_PARAMETERS:
        if name in stored.parameters:
            del stored.parameters[name]
    return stored


def _marked(response: kserve.ModelInferResponse, how: str, request_id: str) -> kserve.ModelInferResponse:
    """A copy for this caller: its own id and the cache outcome (coalesced callers share one object)."""
    mine = kserve.ModelInferResponse()
    mine.CopyFrom(response)
    mine.id = request_id
    mine.parameters["sluice_cache"].string_param = how
    return mine
