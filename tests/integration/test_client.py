"""The client library against a real grpc.aio server on a loopback port: retries, hints, keys, decoding.

The server fails the first N attempts with UNAVAILABLE and the trailers the router sends (built by
`sluice_inference.common.grpc_errors.trailers_for`), then answers y = 2x + 1; it records every attempt's
metadata and time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest

from sluice_inference.bench.loadgen_sink import Context, SinkServer, SinkServicer
from sluice_inference.common.client import RetryBudget, SluiceClient, SyncSluiceClient
from sluice_inference.common.errors import InvalidArgument, SluiceError, Unavailable
from sluice_inference.common.grpc_errors import grpc_code, trailers_for
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.tensors import from_raw

pytestmark = pytest.mark.integration

HINT_S = 0.05


@dataclass(frozen=True)
class Seen:
    """One attempt as the server saw it."""

    at: float
    metadata: dict[str, str]


class FlakyServicer(SinkServicer):
    """Fails the first `fail_first` attempts with `error`, then computes y = 2x + 1."""

    def __init__(self, fail_first: int, error: SluiceError) -> None:
        super().__init__()
        self.fail_first = fail_first
        self.error = error
        self.seen: list[Seen] = []

    async def ModelInfer(
        self, request: kserve.ModelInferRequest, context: Context
    ) -> kserve.ModelInferResponse:
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self.seen.append(Seen(time.monotonic(), metadata))
        if len(self.seen) <= self.fail_first:
            await context.abort(
                grpc_code(self.error.code), self.error.message, trailing_metadata=trailers_for(self.error)
            )
        spec = request.inputs[0]
        x = from_raw(spec.name, spec.datatype, spec.shape, request.raw_input_contents[0])
        response = kserve.ModelInferResponse(model_name=request.model_name, model_version="7")
        response.outputs.add(name="y", datatype="FP32", shape=list(x.shape))
        response.raw_output_contents.append((2 * x + 1).astype("<f4").tobytes())
        response.parameters["sluice_batch_size"].int64_param = 2
        response.parameters["sluice_worker"].string_param = "w-test"
        return response


@dataclass
class Served:
    """A running flaky server and its address."""

    servicer: FlakyServicer
    addr: str


async def _serve(servicer: FlakyServicer) -> AsyncIterator[Served]:
    server = SinkServer(servicer)
    addr = await server.start()
    try:
        yield Served(servicer, addr)
    finally:
        await server.stop(0)


@pytest.fixture
async def flaky() -> AsyncIterator[Served]:
    """Fails twice with a retryable UNAVAILABLE (hint 50 ms), then succeeds."""
    async for served in _serve(
        FlakyServicer(2, Unavailable("queue full", reason="queue_full", retry_after_s=HINT_S))
    ):
        yield served


@pytest.fixture
async def terminal() -> AsyncIterator[Served]:
    """Fails once with INVALID_ARGUMENT, then would succeed."""
    async for served in _serve(FlakyServicer(1, InvalidArgument("input 'x': bad shape", reason="bad_shape"))):
        yield served


X = np.arange(8, dtype=np.float32).reshape(2, 4)


async def test_retries_after_the_hint_with_one_idempotency_key(flaky: Served) -> None:
    async with SluiceClient(flaky.addr, api_key="k1", default_timeout_s=5.0) as client:
        result = await client.infer("synthetic", {"x": X}, priority=1)
    seen = flaky.servicer.seen
    assert result.attempts == 3 and len(seen) == 3
    np.testing.assert_array_equal(result.outputs["y"], 2 * X + 1)
    assert (result.model_version, result.batch_size, result.worker) == ("7", 2, "w-test")
    keys = {s.metadata["idempotency-key"] for s in seen}
    assert len(keys) == 1
    assert all(s.metadata["authorization"] == "Bearer k1" for s in seen)
    for before, after in itertools.pairwise(seen):
        waited = after.at - before.at
        assert HINT_S <= waited < HINT_S * 1.5 + 0.05, waited  # the hint times jitter in [1, 1.5)


async def test_gives_up_with_the_typed_error_when_attempts_run_out(flaky: Served) -> None:
    async with SluiceClient(flaky.addr, max_attempts=2) as client:
        with pytest.raises(Unavailable) as raised:
            await client.infer("synthetic", {"x": X})
    assert raised.value.reason == "queue_full"
    assert raised.value.retry_after_s == pytest.approx(HINT_S)
    assert raised.value.message == "queue full"
    assert len(flaky.servicer.seen) == 2


async def test_terminal_errors_are_not_retried(terminal: Served) -> None:
    async with SluiceClient(terminal.addr) as client:
        with pytest.raises(InvalidArgument) as raised:
            await client.infer("synthetic", {"x": X})
    assert raised.value.reason == "bad_shape" and raised.value.retry_after_s is None
    assert len(terminal.servicer.seen) == 1


async def test_no_retry_past_the_deadline(flaky: Served) -> None:
    flaky.servicer.error = Unavailable("shed", reason="shed", retry_after_s=1.0)
    async with SluiceClient(flaky.addr, retry_budget=RetryBudget(ratio=1.0)) as client:
        start = time.monotonic()
        with pytest.raises(Unavailable):
            await client.infer("synthetic", {"x": X}, timeout_s=0.5)
        assert time.monotonic() - start < 0.5
    assert len(flaky.servicer.seen) == 1


async def test_dns_target_with_round_robin(flaky: Served) -> None:
    flaky.servicer.fail_first = 0
    port = flaky.addr.rsplit(":", 1)[1]
    async with SluiceClient(f"dns:///127.0.0.1:{port}") as client:
        assert (await client.infer("synthetic", {"x": X})).attempts == 1


async def test_unreachable_server_is_a_typed_retryable_error() -> None:
    async with SluiceClient(f"127.0.0.1:{free_port()}", max_attempts=2) as client:  # nothing listens there
        with pytest.raises(Unavailable) as raised:
            await client.infer("synthetic", {"x": X}, timeout_s=2.0)
    assert raised.value.retry_after_s is None  # the transport's failure carries no server hint


async def test_sync_client(flaky: Served) -> None:
    def call() -> np.typing.NDArray[np.float32]:
        with SyncSluiceClient(flaky.addr, default_timeout_s=5.0) as client:
            return client.infer("synthetic", {"x": X}).outputs["y"]

    y = await asyncio.to_thread(call)  # the sync client runs its own loop, in its own thread
    np.testing.assert_array_equal(y, 2 * X + 1)
