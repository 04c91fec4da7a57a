"""The idempotency gate on its own, over the in-process store: no key, no record; a stored success
replays as the same result under the retry's id; a stored failure replays as the same error; a stored
result that cannot be read is refused, never guessed at."""

from __future__ import annotations

import pytest

from sluice_inference.common.clock import FakeClock
from sluice_inference.common.errors import Code, NotFound, SluiceError, Unavailable
from sluice_inference.common.serving_settings import IdempotencySettings
from sluice_inference.router.calls import CacheOutcome, InferCall, InferResult, ServedBy, Tensor
from sluice_inference.router.codec import decode_call
from sluice_inference.router.idempotency_gate import Claimed, IdempotencyGate
from sluice_inference.router.metrics import RouterMetrics
from sluice_inference.router.policy.idempotency import StoredSuccess
from sluice_inference.router.stores.idempotency_store import InProcessIdempotencyStore
from tests.support.dataplane import mlp, raw_call

RECORD = mlp("1")
RESULT = InferResult(
    "mlp", "1", "first", (Tensor("y", "FP32", (1, 1), b"\x00\x00\x80?"),), ServedBy("w1", 2, 0.5),
    CacheOutcome.MISS,
)  # fmt: skip


def gate() -> IdempotencyGate:
    clock = FakeClock()
    return IdempotencyGate(
        InProcessIdempotencyStore(clock=clock), IdempotencySettings(), clock, RouterMetrics()
    )


async def begin(idempotency: IdempotencyGate, call: InferCall) -> Claimed | InferResult | None:
    decoded = decode_call(call, RECORD)
    return await idempotency.begin("gold", call, decoded=decoded, parameters={}, remaining_s=5.0)


def keyed(request_id: str, key: str | None = "key-1") -> InferCall:
    return raw_call([1.0, 2.0, 3.0, 4.0], id=request_id, idempotency_key=key)


async def test_a_call_without_a_key_is_not_recorded() -> None:
    idempotency = gate()
    assert await begin(idempotency, keyed("a", key=None)) is None
    assert idempotency.store.stats.proceeds == 0


async def test_a_stored_success_replays_as_the_same_result_under_the_retrys_id() -> None:
    idempotency = gate()
    claimed = await begin(idempotency, keyed("first"))
    assert isinstance(claimed, Claimed)
    await idempotency.succeeded(claimed, RESULT)
    replay = await begin(idempotency, keyed("retry"))
    assert isinstance(replay, InferResult)
    assert replay.replayed and replay.id == "retry"
    assert (replay.outputs, replay.served, replay.cache, replay.model_version) == (
        RESULT.outputs, RESULT.served, RESULT.cache, "1",
    )  # fmt: skip


async def test_a_stored_failure_replays_as_the_same_error() -> None:
    idempotency = gate()
    claimed = await begin(idempotency, keyed("first"))
    assert isinstance(claimed, Claimed)
    await idempotency.failed(claimed, NotFound("model 'mlp' has no version '9'", reason="unknown_version"))
    with pytest.raises(SluiceError) as caught:
        await begin(idempotency, keyed("retry"))
    assert (caught.value.code, caught.value.reason) == (Code.NOT_FOUND, "replayed_error")
    assert caught.value.message == "model 'mlp' has no version '9'"


async def test_a_retryable_failure_releases_the_key() -> None:
    idempotency = gate()
    claimed = await begin(idempotency, keyed("first"))
    assert isinstance(claimed, Claimed)
    await idempotency.failed(claimed, Unavailable("shed", reason="shed"))
    assert isinstance(await begin(idempotency, keyed("retry")), Claimed)


async def test_a_stored_result_that_cannot_be_read_is_refused_not_guessed() -> None:
    idempotency = gate()
    claimed = await begin(idempotency, keyed("first"))
    assert isinstance(claimed, Claimed)
    await idempotency.store.complete(claimed.ticket, StoredSuccess(b"\xff\xff garbage", "1"), 60.0)
    with pytest.raises(SluiceError) as caught:
        await begin(idempotency, keyed("retry"))
    assert (caught.value.code, caught.value.reason) == (Code.UNAVAILABLE, "idempotency_record_unreadable")


async def test_a_malformed_key_is_invalid_argument() -> None:
    with pytest.raises(SluiceError) as caught:
        await begin(gate(), keyed("a", key="tab\there"))
    assert (caught.value.code, caught.value.reason) == (Code.INVALID_ARGUMENT, "bad_idempotency_key")
