"""Idempotency keys around one inference call: claim before any work, replay, complete or release after.

One logical call = one `idempotency-key` (scoped by tenant). The gate computes the request's fingerprint
(as sent: model, requested version, canonical inputs, outputs, parameters other than priority, timeout and
cache), claims the key, and either hands back a replayed response (with `sluice_replayed=true`, even if a
newer version has rolled out since — the stored response names the version that produced it), or lets
the call run and then stores its outcome: a success or a terminal error is stored and replayed, a
retryable failure (or a cancellation) releases the key so the retry executes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.clock import Clock
from common.config import IdempotencySettings
from common.errors import SluiceError, error_for_code
from common.pb.inference import grpc_service_pb2 as kserve
from router.codec import DecodedRequest, ParamValue
from router.metrics import RouterMetrics
from router.policy.cache_keys import request_fingerprint, tensors_from
from router.policy.idempotency import (
    Replay,
    StoredError,
    StoredResponse,
    Ticket,
    lease_seconds,
    scoped_key,
    settle,
    validate_key,
)
from router.stores.idempotency_store import IdempotencyStore, acquire

IDEMPOTENCY_HEADER = "idempotency-key"


@dataclass(frozen=True)
class Claimed:
    """This call owns the key: run it, then `finish`."""

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
        key: str | None,
        tenant: str,
        request: kserve.ModelInferRequest,
        *,
        decoded: DecodedRequest,
        parameters: Mapping[str, ParamValue],
        remaining_s: float,
    ) -> Claimed | kserve.ModelInferResponse | None:
        """None without a key; a replayed response; or a claim. Raises FAILED_PRECONDITION on a key reused
        with another request, UNAVAILABLE when the store is down (fail closed), DEADLINE_EXCEEDED when the
        first call is still running at our deadline."""
        if key is None:
            return None
        scoped = scoped_key(tenant, validate_key(key))
        fingerprint = request_fingerprint(
            model=request.model_name,
            requested_version=request.model_version,
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
            return _replayed(claim, request.id)
        self._metrics.idempotency.labels(model, "claimed").inc()
        return Claimed(claim.ticket, model)

    async def succeeded(self, claimed: Claimed, response: kserve.ModelInferResponse) -> None:
        """Store a successful response for replay."""
        outcome = StoredResponse(response.SerializeToString(), response.model_version)
        await self.store.complete(claimed.ticket, outcome, self._settings.ttl_s)

    async def failed(self, claimed: Claimed, error: SluiceError | None) -> None:
        """Store a terminal error for replay, or release the key for a retryable one (None: cancelled)."""
        if error is not None and settle(int(error.code)) == "store":
            await self.store.complete(
                claimed.ticket, StoredError(int(error.code), error.message), self._settings.ttl_s
            )
        else:
            await self.store.release(claimed.ticket)


def _replayed(claim: Replay, request_id: str) -> kserve.ModelInferResponse:
    outcome = claim.outcome
    if isinstance(outcome, StoredError):
        raise error_for_code(outcome.code, outcome.message, reason="replayed_error")
    response = kserve.ModelInferResponse.FromString(outcome.response_bytes)
    response.id = request_id
    response.parameters["sluice_replayed"].bool_param = True
    return response
