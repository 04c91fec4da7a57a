"""Idempotency keys around one inference call: claim before any work, replay, complete or release after.

One logical call = one `idempotency-key` (scoped by tenant). The gate computes the call's fingerprint
(as sent: model, requested version, canonical inputs, outputs, parameters other than priority, timeout and
cache), claims the key, and either hands back a replayed result (`replayed`, even if a newer version has
rolled out since — the stored result names the version that produced it), or lets the call run and then
stores its outcome: a success (in its stored form, `router/stored_results.py`) or a terminal error is
stored and replayed, a retryable failure (or a cancellation) releases the key so the retry executes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from sluice_inference.common.clock import Clock
from sluice_inference.common.errors import SluiceError, Unavailable, error_for_code
from sluice_inference.common.serving_settings import IdempotencySettings
from sluice_inference.router.calls import InferCall, InferResult
from sluice_inference.router.codec import DecodedRequest
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.cache_keys import ParamValue, request_fingerprint, tensors_from
from sluice_inference.router.policy.idempotency import (
    Replay,
    StoredError,
    StoredSuccess,
    Ticket,
    lease_seconds,
    scoped_key,
    settle,
    validate_key,
)
from sluice_inference.router.stored_results import decode_result, encode_result
from sluice_inference.router.stores.idempotency_store import IdempotencyStore, acquire

UNREADABLE_RETRY_S = 1.0


@dataclass(frozen=True)
class Claimed:
    """This call owns the key: run it, then `succeeded` or `failed`."""

    ticket: Ticket
    model: str


class IdempotencyGate:
    """Claims, replays and settles idempotency keys against a store (in-process or Redis)."""

    def __init__(
        self, store: IdempotencyStore, settings: IdempotencySettings, clock: Clock, metrics: RouterMetrics
    ) -> None:
        self.store = store
        self._settings = settings
        self._clock = clock
        self._metrics = metrics

    async def begin(
        self,
        tenant: str,
        call: InferCall,
        *,
        decoded: DecodedRequest,
        parameters: Mapping[str, ParamValue],
        remaining_s: float,
    ) -> Claimed | InferResult | None:
        """None for a call without a key; a replayed result; or a claim. Raises FAILED_PRECONDITION on a
        key reused with another request, UNAVAILABLE when the store is down (fail closed), DEADLINE_EXCEEDED
        when the first call is still running at our deadline, and the stored error of a replayed failure."""
        if call.idempotency_key is None:
            return None
        scoped = scoped_key(tenant, validate_key(call.idempotency_key))
        fingerprint = request_fingerprint(
            model=call.model_name,
            requested_version=call.model_version,
            inputs=tensors_from(decoded.inputs),
            outputs=decoded.outputs,
            parameters=parameters,
        )
        model = decoded.record.name
        try:
            claim = await acquire(
                self.store,
                scoped,
                fingerprint,
                lease_s=lease_seconds(remaining_s),
                wait_s=remaining_s,
                clock=self._clock,
                tenant=tenant,
            )
        except SluiceError as err:
            self._metrics.idempotency.labels(model, err.reason).inc()
            raise
        if isinstance(claim, Replay):
            self._metrics.idempotency.labels(model, "replayed").inc()
            return _replayed(claim, call.id)
        self._metrics.idempotency.labels(model, "claimed").inc()
        return Claimed(claim.ticket, model)

    async def succeeded(self, claimed: Claimed, result: InferResult) -> None:
        """Store a successful result for replay."""
        outcome = StoredSuccess(encode_result(result), result.model_version)
        await self.store.complete(claimed.ticket, outcome, self._settings.ttl_s)

    async def failed(self, claimed: Claimed, error: SluiceError | None) -> None:
        """Store a terminal error for replay, or release the key for a retryable one (None: cancelled)."""
        if error is not None and settle(int(error.code)) == "store":
            await self.store.complete(
                claimed.ticket, StoredError(int(error.code), error.message), self._settings.ttl_s
            )
        else:
            await self.store.release(claimed.ticket)


def _replayed(claim: Replay, request_id: str) -> InferResult:
    outcome = claim.outcome
    if isinstance(outcome, StoredError):
        raise error_for_code(outcome.code, outcome.message, reason="replayed_error")
    try:
        result = decode_result(outcome.result_bytes, request_id=request_id)
    except ValueError as exc:  # refuse rather than guess, as the store does for an unreadable record
        raise Unavailable(
            f"unreadable idempotency record ({exc})",
            reason="idempotency_record_unreadable",
            retry_after_s=UNREADABLE_RETRY_S,
        ) from exc
    return dataclasses.replace(result, replayed=True)
