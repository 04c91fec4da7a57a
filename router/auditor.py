"""Proof that cache hits are right: recompute a sample of them on a worker and compare.

A configurable share of hits (`cache.audit_fraction`) is re-run through the normal path as the internal
`__audit__` tenant at the lowest priority, so an audit waits behind all real traffic and is the first
request shed under pressure — it never displaces real work; a shed or expired audit is simply skipped.
Outputs are compared byte for byte (or within `cache.audit_tolerance` for floating point). A mismatch is
counted, logged at ERROR with the model digest, and disables caching for that digest on this router (and
purges its entries), because a cache that returned one wrong answer cannot be trusted for the next.

The data plane hands every hit to `on_hit` (router/dataplane.py); the auditor needs the gate only to
disable a digest and purge its entries, so neither object patches the other.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import numpy as np

from common.clock import Clock
from common.config import CacheSettings, TenantSettings
from common.errors import SluiceError
from common.records import ModelRecord
from common.tensors import dtype_of
from router.cache_gate import CacheGate
from router.calls import InferResult, Tensor
from router.codec import DecodedRequest, Executor, requested_outputs
from router.metrics import RouterMetrics
from router.policy.admission import AUDIT_PRIORITY, AUDIT_TENANT
from router.policy.tenants import Tenant

log = logging.getLogger(__name__)

AUDIT_TIMEOUT_S = 30.0
_AUDITOR = Tenant(
    AUDIT_TENANT,
    TenantSettings(
        rate=1e9,
        burst=10**9,
        max_inflight=10**9,
        default_priority=AUDIT_PRIORITY,
        max_priority=AUDIT_PRIORITY,
    ),
)


def same_outputs(cached: Sequence[Tensor], fresh: Sequence[Tensor], tolerance: float) -> bool:
    """Whether two results carry the same outputs (bytes, or floats within `tolerance`)."""
    mine = {t.name: t for t in cached}
    theirs = {t.name: t for t in fresh}
    if mine.keys() != theirs.keys():
        return False
    for name, tensor in mine.items():
        other = theirs[name]
        if tensor.datatype != other.datatype or tensor.shape != other.shape:
            return False
        if tensor.data == other.data:
            continue
        dtype = dtype_of(tensor.datatype)
        if tolerance <= 0 or dtype.kind != "f":
            return False
        if not np.allclose(
            np.frombuffer(tensor.data, dtype), np.frombuffer(other.data, dtype), rtol=0, atol=tolerance
        ):
            return False
    return True


class CacheAuditor:
    """Samples the hits it is given and re-runs them in the background."""

    def __init__(
        self,
        executor: Executor,
        gate: CacheGate,
        *,
        settings: CacheSettings,
        metrics: RouterMetrics,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        self._executor = executor
        self._gate = gate
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task[None]] = set()

    def on_hit(self, record: ModelRecord, decoded: DecodedRequest, cached: InferResult) -> None:
        """Maybe schedule an audit of this hit."""
        if self._rng.random() >= self._settings.audit_fraction:
            return
        task = asyncio.create_task(self._audit(record, decoded, cached))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _audit(self, record: ModelRecord, decoded: DecodedRequest, cached: InferResult) -> None:
        now = self._clock.now()
        deadline = now + AUDIT_TIMEOUT_S
        try:
            reply = await self._executor.infer(decoded, deadline, _AUDITOR, AUDIT_PRIORITY, arrival=now)
        except SluiceError as err:
            self._metrics.cache_audits.labels(record.name, f"skipped_{err.reason}").inc()
            return
        fresh = requested_outputs(decoded, reply.outputs)
        if same_outputs(cached.outputs, fresh, self._settings.audit_tolerance):
            self._metrics.cache_audits.labels(record.name, "match").inc()
            return
        self._metrics.cache_audits.labels(record.name, "mismatch").inc()
        log.error(
            "CACHE AUDIT MISMATCH: a cached result of %s version %s (digest %s) differs from a fresh run; "
            "caching is now disabled for this digest on this router and its entries are purged",
            record.name, record.version, record.digest,
        )  # fmt: skip
        self._gate.disable(record.digest)
        try:
            await self._gate.store.purge_model(record.name, record.version)
        except SluiceError as err:
            log.error("could not purge the cache after a failed audit: %s", err.message)

    async def stop(self) -> None:
        """Cancel audits in progress."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
