"""Proof that cache hits are right: recompute a sample of them on a worker and compare.

The rules (which hits, how close, what a mismatch costs) live in `router/policy/cache_audit.py`; this
module runs them. A sampled hit within its tenant's audit budget is re-run through the normal path as the
internal `__audit__` tenant at the lowest priority, so an audit waits behind all real traffic and is the
first request shed under pressure — it never displaces real work; a shed or expired audit is skipped.
When the outputs are not within the model version's current tolerance, the input is run once more with its
rows repeated into a batch, to measure how far this model's batched rows lie from its single rows; that
measurement is learned for the version and the verdict given against it. A mismatch removes the entry and
is charged to the tenant whose hit it was (`CacheGate.quarantine`), logged at ERROR and counted in
`sluice_cache_audits_total{outcome="mismatch"}` and `sluice_cache_audit_mismatches_total{model, tenant}`.

The data plane hands every hit to `on_hit` (router/dataplane.py); the auditor needs the gate only to
quarantine an entry, so neither object patches the other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Sequence

from sluice_inference.common.clock import Clock
from sluice_inference.common.errors import SluiceError
from sluice_inference.common.records import ModelRecord
from sluice_inference.common.serving_settings import CacheSettings, TenantSettings
from sluice_inference.router.cache_gate import CacheGate
from sluice_inference.router.calls import InferResult, Tensor
from sluice_inference.router.codec import DecodedRequest, Executor, requested_outputs
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.admission import AUDIT_PRIORITY, AUDIT_TENANT
from sluice_inference.router.policy.cache_audit import AuditBudget, DeviationBook, difference
from sluice_inference.router.policy.tenants import Tenant

log = logging.getLogger(__name__)

AUDIT_TIMEOUT_S = 30.0
CALIBRATION_MAX_ROWS = 32
"""Rows of the batch a calibration runs (at most; never more than the model's max_batch_size)."""
CALIBRATION_MAX_BYTES = 4 * 1024 * 1024
"""Input bytes a calibration may send."""
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


def calibration_request(decoded: DecodedRequest) -> DecodedRequest | None:
    """The audited request with its rows repeated into a batch of up to `CALIBRATION_MAX_ROWS` rows (its
    rows come first), or None when the model cannot batch at least twice its rows."""
    limit = min(decoded.record.max_batch_size, CALIBRATION_MAX_ROWS)
    times = min(limit // max(1, decoded.rows), CALIBRATION_MAX_BYTES // max(1, decoded.input_bytes))
    if decoded.rows < 1 or times < 2:
        return None
    inputs = tuple(
        Tensor(t.name, t.datatype, (t.shape[0] * times, *t.shape[1:]), t.data * times) for t in decoded.inputs
    )
    return dataclasses.replace(
        decoded,
        client_id="",
        inputs=inputs,
        rows=decoded.rows * times,
        cost=decoded.cost * times,
        response_bytes=decoded.response_bytes * times,
    )


def first_rows(outputs: Sequence[Tensor], rows: int) -> tuple[Tensor, ...]:
    """Each output cut to its first `rows` rows (the audited request's own, in a calibration batch)."""
    cut = []
    for t in outputs:
        total = t.shape[0] if t.shape else 0
        size = len(t.data) // total * rows if total else 0
        cut.append(Tensor(t.name, t.datatype, (rows, *t.shape[1:]), t.data[:size]))
    return tuple(cut)


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
        self.budget = AuditBudget(
            fraction=settings.audit_fraction,
            rate=settings.audit_rate,
            burst=settings.audit_burst,
            max_inflight=settings.audit_max_inflight,
        )
        self.deviations = DeviationBook(settings.audit_margin)

    def on_hit(
        self, tenant: str, key: str, record: ModelRecord, decoded: DecodedRequest, cached: InferResult
    ) -> None:
        """Maybe schedule an audit of this hit (of `tenant`, of the entry under `key`)."""
        if not self.budget.admit(tenant, self._clock.now(), self._rng.random()):
            return
        task = asyncio.create_task(self._audit(tenant, key, record, decoded, cached))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _audit(
        self, tenant: str, key: str, record: ModelRecord, decoded: DecodedRequest, cached: InferResult
    ) -> None:
        try:
            outcome = await self._judge(record, decoded, cached)
        except SluiceError as err:
            self._metrics.cache_audits.labels(record.name, f"skipped_{err.reason}").inc()
            return
        finally:
            self.budget.finished()
        self._metrics.cache_audits.labels(record.name, outcome).inc()
        if outcome != "mismatch":
            return
        self._metrics.cache_audit_mismatches.labels(record.name, self._metrics.tenant_label(tenant)).inc()
        banned = await self._gate.quarantine(key, tenant, record.name)
        then = f"; tenant {tenant}'s requests to {record.name} now bypass the cache here" if banned else ""
        log.error(
            "CACHE AUDIT MISMATCH: a cached result of %s version %s (digest %s) hit by tenant %s differs "
            "from a fresh run beyond the model's measured deviation; the entry is purged%s",
            record.name, record.version, record.digest, tenant, then,
        )  # fmt: skip

    async def _judge(self, record: ModelRecord, decoded: DecodedRequest, cached: InferResult) -> str:
        """`match`, `match_calibrated` (within the deviation measured by a calibration run) or
        `mismatch`; SluiceError when a run could not be done."""
        fresh = await self._run(decoded)
        gap = difference(cached.outputs, fresh)
        floor = self._settings.audit_tolerance
        if gap.exact or gap.within(self.deviations.limit(record.name, record.version, gap.epsilon), floor):
            return "match"
        batch = calibration_request(decoded)
        if batch is None or not gap.comparable:
            return "mismatch"
        batched = difference(first_rows(await self._run(batch), decoded.rows), fresh)
        if not batched.comparable:
            return "mismatch"  # the model's batched rows are not even the same kind of result
        measured = self.deviations.learn(record.name, record.version, batched.relative)
        log.info("cache audit: %s version %s deviates up to %.3g (relative) batched vs alone",
                 record.name, record.version, measured)  # fmt: skip
        limit = self.deviations.limit(record.name, record.version, gap.epsilon)
        return "match_calibrated" if gap.within(limit, floor) else "mismatch"

    async def _run(self, decoded: DecodedRequest) -> tuple[Tensor, ...]:
        now = self._clock.now()
        deadline = now + AUDIT_TIMEOUT_S
        reply = await self._executor.infer(decoded, deadline, _AUDITOR, AUDIT_PRIORITY, arrival=now)
        return requested_outputs(decoded, reply.outputs)

    async def drain(self) -> None:
        """Wait until the audits in progress have ended (each is bounded by AUDIT_TIMEOUT_S per run)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel audits in progress."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
