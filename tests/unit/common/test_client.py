"""The client's retry loop, driven through a fake transport with a fake clock and a seeded rng (no gRPC).

Nothing here sleeps for real: the fake sleep advances the fake clock, and the fake transport advances it by
its service time, honouring the attempt's timeout as a real channel would.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from sluice_inference.common.client import (
    ROUND_ROBIN_SERVICE_CONFIG,
    InferResult,
    Metadata,
    RetryBucket,
    RetryBudget,
    SluiceClient,
    build_request,
    channel_options,
)
from sluice_inference.common.clock import FakeClock
from sluice_inference.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SluiceError,
    Unauthenticated,
    Unavailable,
)
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve

Outcome = SluiceError | kserve.ModelInferResponse


def ok_response(value: float = 1.0) -> kserve.ModelInferResponse:
    """A response with one FP32 [1, 2] output and Sluice's response parameters."""
    response = kserve.ModelInferResponse(model_name="m", model_version="3")
    response.outputs.add(name="y", datatype="FP32", shape=[1, 2])
    response.raw_output_contents.append(np.full((1, 2), value, "<f4").tobytes())
    response.parameters["sluice_batch_size"].int64_param = 4
    response.parameters["sluice_worker"].string_param = "w1"
    response.parameters["sluice_cache"].string_param = "miss"
    response.parameters["sluice_replayed"].bool_param = True
    response.parameters["sluice_queue_us"].int64_param = 1500
    return response


@dataclass
class Attempt:
    """What the transport saw for one attempt."""

    started_at: float
    timeout_s: float
    metadata: Metadata
    request: kserve.ModelInferRequest


@dataclass
class FakeTransport:
    """Answers attempts from a script (the last entry repeats), taking `service_s` of fake time each."""

    clock: FakeClock
    script: list[Outcome]
    service_s: float = 0.001
    attempts: list[Attempt] = field(default_factory=list)
    closed: bool = False

    async def model_infer(
        self, request: kserve.ModelInferRequest, *, metadata: Metadata, timeout_s: float
    ) -> kserve.ModelInferResponse:
        self.attempts.append(Attempt(self.clock.now(), timeout_s, metadata, request))
        if self.service_s > timeout_s:  # a real channel ends the call at its deadline
            self.clock.advance(timeout_s)
            raise DeadlineExceeded("Deadline Exceeded")
        self.clock.advance(self.service_s)
        outcome = self.script[min(len(self.attempts), len(self.script)) - 1]
        if isinstance(outcome, SluiceError):
            raise outcome
        return outcome

    async def close(self) -> None:
        self.closed = True


@dataclass
class Harness:
    """A client wired to a fake transport, clock and sleep."""

    clock: FakeClock
    transport: FakeTransport
    client: SluiceClient
    sleeps: list[float]


def harness(
    script: list[Outcome],
    *,
    service_s: float = 0.001,
    max_attempts: int = 3,
    budget: RetryBudget | None = None,
    api_key: str | None = None,
    seed: int = 7,
) -> Harness:
    clock = FakeClock(100.0)
    transport = FakeTransport(clock, script, service_s)
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.advance(seconds)

    client = SluiceClient(
        "unused:1",
        api_key=api_key,
        max_attempts=max_attempts,
        retry_budget=budget or RetryBudget(),
        rng=random.Random(seed),
        clock=clock,
        sleep=sleep,
        transport=transport,
    )
    return Harness(clock, transport, client, sleeps)


X = {"x": np.ones((1, 2), np.float32)}


def unavailable(hint: float | None = 0.05) -> Unavailable:
    return Unavailable("queue full", reason="queue_full", retry_after_s=hint)


async def test_success_decodes_outputs_and_response_parameters() -> None:
    h = harness([ok_response(2.5)])
    result = await h.client.infer("m", X)
    assert isinstance(result, InferResult)
    np.testing.assert_array_equal(result.outputs["y"], np.full((1, 2), 2.5, np.float32))
    assert (result.model_version, result.batch_size, result.worker) == ("3", 4, "w1")
    assert (result.cache, result.replayed, result.attempts) == ("miss", True, 1)
    assert result.queue_s == pytest.approx(0.0015)
    assert result.latency_s == pytest.approx(0.001)
    assert h.sleeps == []


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgument("bad shape"),
        NotFound("no model"),
        Unauthenticated("no key"),
        PermissionDenied("not allowed"),
        FailedPrecondition("key reused"),
        DeadlineExceeded("too late"),
        Internal("model raised"),
    ],
)
async def test_terminal_errors_are_raised_at_once(error: SluiceError) -> None:
    h = harness([error, ok_response()])
    with pytest.raises(type(error)) as raised:
        await h.client.infer("m", X)
    assert raised.value is error
    assert len(h.transport.attempts) == 1 and h.sleeps == []


@pytest.mark.parametrize(
    "error",
    [unavailable(), ResourceExhausted("tenant rate limit", reason="rate_limited", retry_after_s=0.05)],
)
async def test_retryable_errors_are_retried(error: SluiceError) -> None:
    h = harness([error, ok_response()])
    result = await h.client.infer("m", X)
    assert result.attempts == 2 and len(h.transport.attempts) == 2
    assert len(h.sleeps) == 1


async def test_waits_the_servers_hint_times_jitter_in_1_to_1_5() -> None:
    h = harness([unavailable(hint=0.2), ok_response()], seed=1, budget=RetryBudget(ratio=1.0))
    waits = []
    for _ in range(200):
        h.transport.attempts.clear()
        await h.client.infer("m", X)
        waits.append(h.sleeps[-1])
    assert all(0.2 <= w < 0.3 for w in waits)
    assert min(waits) < 0.21 and max(waits) > 0.29  # the whole jitter range is used
    assert np.mean(waits) == pytest.approx(0.25, abs=0.01)


async def test_without_a_hint_backoff_is_exponential_with_jitter() -> None:
    h = harness([unavailable(hint=None)], max_attempts=4, budget=RetryBudget(min_per_s=100))
    with pytest.raises(Unavailable):
        await h.client.infer("m", X)
    first, second, third = h.sleeps
    assert 0.025 <= first < 0.075
    assert 0.05 <= second < 0.15
    assert 0.1 <= third < 0.3
    assert h.client.backoff(30, None) < 2.0 * 1.5  # capped


async def test_attempts_are_capped_and_the_last_error_is_raised() -> None:
    errors: list[Outcome] = [unavailable(), unavailable(), unavailable(), ok_response()]
    h = harness(errors, max_attempts=3)
    with pytest.raises(Unavailable) as raised:
        await h.client.infer("m", X)
    assert raised.value is errors[2]
    assert raised.value.retry_after_s == 0.05 and raised.value.reason == "queue_full"
    assert len(h.transport.attempts) == 3
    assert any("max_attempts" in note for note in raised.value.__notes__)


async def test_one_idempotency_key_across_the_attempts_of_a_call() -> None:
    h = harness([unavailable(), unavailable(), ok_response()], api_key="secret")
    await h.client.infer("m", X)
    keys = {dict(a.metadata)["idempotency-key"] for a in h.transport.attempts}
    assert len(keys) == 1 and len(h.transport.attempts) == 3
    assert all(dict(a.metadata)["authorization"] == "Bearer secret" for a in h.transport.attempts)
    assert len({id(a.request) for a in h.transport.attempts}) == 1  # the same request bytes every time

    h.transport.attempts.clear()
    h.transport.script = [ok_response()]
    await h.client.infer("m", X)
    assert dict(h.transport.attempts[0].metadata)["idempotency-key"] not in keys  # a new call, a new key


async def test_a_given_idempotency_key_is_used_and_checked() -> None:
    h = harness([unavailable(), ok_response()])
    await h.client.infer("m", X, idempotency_key="order-42")
    assert {dict(a.metadata)["idempotency-key"] for a in h.transport.attempts} == {"order-42"}
    assert "authorization" not in dict(h.transport.attempts[0].metadata)
    for bad in ("", "x" * 256, "caf\u00e9", "tab\there"):
        with pytest.raises(InvalidArgument):
            await h.client.infer("m", X, idempotency_key=bad)
    assert len(h.transport.attempts) == 2  # invalid keys never reach the wire


async def test_the_deadline_is_never_exceeded() -> None:
    # Each attempt takes 0.3 s and is pushed back 0.25 s: the third attempt gets only what is left.
    h = harness([unavailable(hint=0.25)], service_s=0.3, max_attempts=10, budget=RetryBudget(min_per_s=100))
    start = h.clock.now()
    with pytest.raises(SluiceError) as raised:
        await h.client.infer("m", X, timeout_s=1.0)
    deadline = start + 1.0
    assert h.clock.now() <= deadline + 1e-9
    assert all(a.started_at + a.timeout_s <= deadline + 1e-9 for a in h.transport.attempts)
    assert h.transport.attempts[0].timeout_s == pytest.approx(1.0)
    assert len(h.transport.attempts) >= 2
    assert isinstance(raised.value, Unavailable | DeadlineExceeded)


async def test_a_wait_that_would_pass_the_deadline_is_not_begun() -> None:
    h = harness([unavailable(hint=2.0), ok_response()])
    with pytest.raises(Unavailable) as raised:
        await h.client.infer("m", X, timeout_s=1.0)
    assert len(h.transport.attempts) == 1 and h.sleeps == []
    assert any("deadline" in note for note in raised.value.__notes__)


async def test_budget_keeps_retries_near_10_percent_under_sustained_failure() -> None:
    h = harness([unavailable(hint=0.01)], max_attempts=3)
    calls = 1000
    start = h.clock.now()
    for _ in range(calls):
        with pytest.raises(Unavailable):
            await h.client.infer("m", X)
    retries = len(h.transport.attempts) - calls
    elapsed = h.clock.now() - start
    assert retries <= 0.1 * calls + 1.0 * (elapsed + 10)  # ratio, plus the 1/s floor and its 10 s reserve
    assert retries >= 0.1 * calls - 1  # and the budget is actually spent
    assert elapsed < 20  # so the floor is a small part of the bound


async def test_budget_floor_allows_a_trickle_of_retries() -> None:
    budget = RetryBudget(ratio=0.0, min_per_s=1.0, floor_window_s=1.0)
    h = harness([unavailable(hint=0.01), ok_response()], budget=budget)
    assert (await h.client.infer("m", X)).attempts == 2  # the floor starts full: one token
    h.transport.attempts.clear()
    with pytest.raises(Unavailable) as raised:
        await h.client.infer("m", X)  # spent, and only ~10 ms has passed
    assert any("budget" in note for note in raised.value.__notes__)
    h.clock.advance(1.0)
    h.transport.attempts.clear()
    assert (await h.client.infer("m", X)).attempts == 2


def test_retry_bucket_caps_saved_tokens() -> None:
    bucket = RetryBucket(RetryBudget(ratio=0.5, min_per_s=0.0, max_tokens=2.0), now=0.0)
    for _ in range(100):
        bucket.deposit()
    assert [bucket.try_withdraw(0.0) for _ in range(3)] == [True, True, False]


def test_request_carries_raw_little_endian_inputs_and_parameters() -> None:
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    request = build_request(
        "m", {"a": big_endian, "b": np.zeros((2,), np.float16)}, version="2", outputs=["y"],
        priority=1, cache=False, request_id="r1",
    )  # fmt: skip
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("a", "INT32", [2, 3]),
        ("b", "FP16", [2]),
    ]
    assert request.raw_input_contents[0] == np.arange(6, dtype="<i4").tobytes()
    assert request.parameters["priority"].int64_param == 1
    assert request.parameters["cache"].bool_param is False
    assert "timeout" not in request.parameters  # the deadline travels as the gRPC deadline only
    assert [o.name for o in request.outputs] == ["y"] and request.model_version == "2" and request.id == "r1"
    default = build_request("m", {"a": big_endian})
    assert "priority" not in default.parameters and "cache" not in default.parameters


async def test_bad_inputs_fail_before_any_attempt() -> None:
    h = harness([ok_response()])
    with pytest.raises(InvalidArgument):
        await h.client.infer("m", {"s": np.array(["text"])})
    with pytest.raises(InvalidArgument):
        await h.client.infer("m", X, priority=-1)
    with pytest.raises(InvalidArgument):
        await h.client.infer("m", X, timeout_s=0)
    assert h.transport.attempts == []


async def test_malformed_response_is_internal() -> None:
    response = ok_response()
    response.raw_output_contents[0] = b"\x00"
    h = harness([response])
    with pytest.raises(Internal):
        await h.client.infer("m", X)


async def test_close_closes_the_transport() -> None:
    h = harness([ok_response()])
    async with h.client as client:
        await client.infer("m", X)
    assert h.transport.closed


def test_dns_targets_balance_round_robin() -> None:
    options = dict(channel_options("dns:///sluice-router.default.svc:8001"))
    assert json.loads(options["grpc.service_config"]) == {"loadBalancingConfig": [{"round_robin": {}}]}
    assert options["grpc.service_config"] == ROUND_ROBIN_SERVICE_CONFIG
    assert "grpc.service_config" not in dict(channel_options("localhost:8001"))
    custom = dict(channel_options("dns:///r:1", [("grpc.service_config", "{}")]))
    assert custom["grpc.service_config"] == "{}"  # an explicit service config wins
