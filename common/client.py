"""The Sluice client library: one logical call = one deadline, one idempotency key, a few budgeted retries.

docs/design.md §5 puts retries in one layer, this one. The rules of a logical call (`SluiceClient.infer`):

1. It has one absolute deadline, `timeout_s` (else `default_timeout_s`) after it starts. Each attempt's gRPC
   timeout is the time left; a wait that would end at or past the deadline is not begun, so no attempt ever
   runs past it. The deadline travels as the gRPC deadline only: `parameters["timeout"]` would change from
   attempt to attempt and make a retry look like a different request to the idempotency check.
2. Only retryable errors (UNAVAILABLE, RESOURCE_EXHAUSTED) are retried, and at most `max_attempts` attempts
   are made in all. Terminal errors (INVALID_ARGUMENT, NOT_FOUND, DEADLINE_EXCEEDED, ...) are raised at once.
3. The wait before a retry is the server's hint (`google.rpc.RetryInfo`; the router mirrors it in
   `grpc-retry-pushback-ms`) times a jitter factor drawn uniformly from [1, 1.5): never sooner than the
   server asked, and spread so a crowd of clients pushed back at the same moment does not return in step.
   Without a hint it is capped exponential backoff, 50 ms * 2^(k-1) (at most 2 s) before retry k, times a
   factor from [0.5, 1.5).
4. Retries spend a budget (`RetryBudget`, a token bucket): every logical call deposits `ratio` tokens
   (capped at `max_tokens`), every retry withdraws one, and a separate floor refills `min_per_s` tokens per
   second (saving up to `floor_window_s` seconds' worth) so a client that sends little can still retry.
   Under sustained failure retries add at most about `ratio` of the offered load (+ `min_per_s`/s), so
   clients do not multiply an overload they are told of.
5. Every attempt of one call carries the same `idempotency-key` (a fresh uuid4 per call unless given), so
   the router answers a retry of a request that did run from its record instead of running it twice.
6. What escapes is a typed `SluiceError` (the last one seen, with its code, message, reason and
   retry_after_s), never a raw grpc error. A refused retry adds a note saying why it stopped.

Time, sleep, randomness and the transport are injected, so unit tests drive this loop with a fake clock.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import grpc
import numpy as np
import numpy.typing as npt

from sluice_inference.common.clock import Clock, MonotonicClock
from sluice_inference.common.errors import Internal, InvalidArgument, SluiceError
from sluice_inference.common.grpc_errors import from_rpc_error
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.tensors import DATATYPES, datatype_of, from_contents, from_raw

Metadata = tuple[tuple[str, str], ...]
Sleep = Callable[[float], Awaitable[None]]

ROUND_ROBIN_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)
"""Match the router's default `max_message_bytes` (64 MiB), above gRPC's 4 MiB receive default."""

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
HINT_JITTER = (1.0, 1.5)
BACKOFF_JITTER = (0.5, 1.5)
MAX_IDEMPOTENCY_KEY = 255


@dataclass(frozen=True)
class RetryBudget:
    """How much retrying a client may add: about `ratio` of its calls, plus `min_per_s` retries a second."""

    ratio: float = 0.1
    """Tokens each logical call deposits; one retry costs one token, so 0.1 allows ~10% extra attempts."""
    min_per_s: float = 1.0
    """A floor of retries per second, for clients that send too little to earn tokens."""
    floor_window_s: float = 10.0
    """The floor saves up at most `min_per_s * floor_window_s` tokens (at least 1; full at start)."""
    max_tokens: float = 100.0
    """Cap on earned tokens: how large a burst of retries a long calm period can fund."""

    def __post_init__(self) -> None:
        if min(self.ratio, self.min_per_s, self.floor_window_s, self.max_tokens) < 0:
            raise ValueError(f"a retry budget cannot be negative: {self}")


class RetryBucket:
    """The mutable state of one `RetryBudget` (one per client); time comes from the caller."""

    def __init__(self, budget: RetryBudget, now: float) -> None:
        self._budget = budget
        self._earned = 0.0
        self._floor_cap = max(1.0, budget.min_per_s * budget.floor_window_s) if budget.min_per_s > 0 else 0.0
        self._floor = self._floor_cap
        self._floor_at = now

    def deposit(self) -> None:
        """A logical call started."""
        self._earned = min(self._budget.max_tokens, self._earned + self._budget.ratio)

    def try_withdraw(self, now: float) -> bool:
        """Take one token for a retry (earned tokens first, then the floor); False if there is none."""
        self._floor = min(self._floor_cap, self._floor + (now - self._floor_at) * self._budget.min_per_s)
        self._floor_at = now
        if self._earned >= 1.0:
            self._earned -= 1.0
            return True
        if self._floor >= 1.0:
            self._floor -= 1.0
            return True
        return False


@dataclass(frozen=True)
class InferResult:
    """A successful logical call: decoded outputs and how the router served it."""

    outputs: dict[str, npt.NDArray[Any]]
    """Output tensors by name (read-only views of the response buffers)."""
    model_version: str
    """The version the router resolved."""
    batch_size: int
    """Rows in the batch this request rode in (`sluice_batch_size`), 0 if not reported."""
    worker: str
    """Worker that executed it (`sluice_worker`)."""
    cache: str
    """`hit`, `miss` or `bypass` (`sluice_cache`); empty when the router did not say."""
    replayed: bool
    """True when the router answered from an earlier attempt's idempotency record (`sluice_replayed`)."""
    attempts: int
    """Attempts made, including the successful one."""
    latency_s: float
    """From the start of the logical call to its answer, retries and waits included."""
    queue_s: float = 0.0
    """Time queued in the router (`sluice_queue_us`)."""


class Transport(Protocol):
    """The seam between the retry loop and the wire; errors come back as typed SluiceErrors."""

    async def model_infer(
        self, request: kserve.ModelInferRequest, *, metadata: Metadata, timeout_s: float
    ) -> kserve.ModelInferResponse:
        """One attempt of ModelInfer."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def channel_options(target: str, extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """Channel options for `target`: the defaults, `extra`, and round_robin for `dns:` targets."""
    options = [*DEFAULT_CHANNEL_OPTIONS, *extra]
    if target.startswith("dns:") and not any(key == "grpc.service_config" for key, _ in options):
        options.append(("grpc.service_config", ROUND_ROBIN_SERVICE_CONFIG))
    return options


class GrpcTransport:
    """ModelInfer over a grpc.aio channel.

    For a `dns:///name:port` target the channel balances per call with `round_robin` over every address the
    name resolves to. Routers run behind a Kubernetes *headless* Service (one DNS A record per pod) because
    gRPC multiplexes every call over one long-lived HTTP/2 connection: behind a ClusterIP Service, or with
    the default `pick_first` policy, each client would pin all of its load on one router. New router pods
    are seen when the resolver re-resolves (gRPC does so whenever a connection drops). Create it inside a
    running event loop.
    """

    def __init__(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=channel_options(target, options))
        self._stub = kserve_grpc.GRPCInferenceServiceStub(self._channel)

    async def model_infer(
        self, request: kserve.ModelInferRequest, *, metadata: Metadata, timeout_s: float
    ) -> kserve.ModelInferResponse:
        """One attempt; a failed call becomes its typed error (with the server's retry hint)."""
        try:
            return await self._stub.ModelInfer(request, metadata=metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        """Close the channel (in-flight calls are cancelled)."""
        await self._channel.close()


def build_request(
    model: str,
    inputs: Mapping[str, npt.NDArray[Any]],
    *,
    version: str = "",
    outputs: Sequence[str] = (),
    priority: int = 0,
    cache: bool | None = None,
    request_id: str = "",
) -> kserve.ModelInferRequest:
    """A ModelInferRequest with every input as raw little-endian bytes; InvalidArgument for bad values."""
    if priority < 0:
        raise InvalidArgument(
            f"priority must be >= 0 (1 is the highest, 0 the tenant default), got {priority}"
        )
    request = kserve.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in inputs.items():
        contiguous = np.ascontiguousarray(array)
        datatype = datatype_of(contiguous.dtype)
        request.inputs.add(name=name, datatype=datatype, shape=list(contiguous.shape))
        request.raw_input_contents.append(contiguous.astype(DATATYPES[datatype], copy=False).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    if priority:
        request.parameters["priority"].int64_param = priority
    if cache is not None:
        request.parameters["cache"].bool_param = cache
    return request


def decode_outputs(response: kserve.ModelInferResponse) -> dict[str, npt.NDArray[Any]]:
    """Output tensors from raw buffers (or typed contents); a malformed response is Internal."""
    raw = response.raw_output_contents
    try:
        if raw and len(raw) != len(response.outputs):
            raise InvalidArgument(f"{len(response.outputs)} outputs but {len(raw)} raw buffers")
        return {
            out.name: from_raw(out.name, out.datatype, out.shape, raw[i])
            if raw
            else from_contents(out.name, out.datatype, out.shape, out.contents)
            for i, out in enumerate(response.outputs)
        }
    except InvalidArgument as err:
        raise Internal(f"malformed response from the server: {err.message}", reason="bad_response") from None


def _result(response: kserve.ModelInferResponse, attempts: int, latency_s: float) -> InferResult:
    params = response.parameters
    return InferResult(
        outputs=decode_outputs(response),
        model_version=response.model_version,
        batch_size=params["sluice_batch_size"].int64_param if "sluice_batch_size" in params else 0,
        worker=params["sluice_worker"].string_param if "sluice_worker" in params else "",
        cache=params["sluice_cache"].string_param if "sluice_cache" in params else "",
        replayed="sluice_replayed" in params and params["sluice_replayed"].bool_param,
        attempts=attempts,
        latency_s=latency_s,
        queue_s=params["sluice_queue_us"].int64_param / 1e6 if "sluice_queue_us" in params else 0.0,
    )


def check_idempotency_key(key: str) -> str:
    """The key, if it is 1-255 printable ASCII characters (docs/design.md §4); else InvalidArgument."""
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY or not all(" " <= c <= "~" for c in key):
        raise InvalidArgument("idempotency key must be 1-255 printable ASCII characters", reason="bad_key")
    return key


class SluiceClient:
    """Asyncio client for a Sluice router (or any KServe v2 server), with budgeted retries.

    `target` is `host:port` or a gRPC URI such as `dns:///sluice-router.ns.svc:8001` (balanced per call
    with round_robin; see `GrpcTransport`). Use it as `async with SluiceClient(...) as client:`, or call
    `close()`. Not shared across event loops.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        default_timeout_s: float = 10.0,
        max_attempts: int = 3,
        retry_budget: RetryBudget = RetryBudget(),  # frozen, so sharing the default is safe
        rng: random.Random | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        clock: Clock | None = None,
        sleep: Sleep | None = None,
        transport: Transport | None = None,
    ) -> None:
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {default_timeout_s}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._api_key = api_key
        self._default_timeout_s = default_timeout_s
        self._max_attempts = max_attempts
        self._rng = rng or random.Random()
        self._clock = clock or MonotonicClock()
        self._sleep: Sleep = sleep or asyncio.sleep
        self._transport = transport or GrpcTransport(target, channel_options)
        self._budget = RetryBucket(retry_budget, self._clock.now())

    async def __aenter__(self) -> SluiceClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection to the router."""
        await self._transport.close()

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, npt.NDArray[Any]],
        *,
        version: str = "",
        outputs: Sequence[str] = (),
        priority: int = 0,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
        cache: bool | None = None,
        request_id: str = "",
    ) -> InferResult:
        """One logical inference call (retried under the rules in this module's docstring).

        `inputs` keep their shapes (the first dim is the batch); `outputs` names the outputs wanted (default
        all); `priority` 1 is the highest, 0 the tenant default; `cache=False` bypasses the result cache.
        Raises a typed `SluiceError`.
        """
        timeout = self._default_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout}")
        request = build_request(
            model, inputs, version=version, outputs=outputs, priority=priority, cache=cache,
            request_id=request_id,
        )  # fmt: skip
        key = check_idempotency_key(idempotency_key) if idempotency_key is not None else str(uuid.uuid4())
        return await self._call(request, self._metadata(key), timeout)

    def _metadata(self, idempotency_key: str) -> Metadata:
        pairs = [("idempotency-key", idempotency_key)]
        if self._api_key is not None:
            pairs.append(("authorization", f"Bearer {self._api_key}"))
        return tuple(pairs)

    async def _call(
        self, request: kserve.ModelInferRequest, metadata: Metadata, timeout_s: float
    ) -> InferResult:
        """The retry loop: attempts until success, a terminal error, or a refused retry."""
        start = self._clock.now()
        deadline = start + timeout_s
        self._budget.deposit()
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._transport.model_infer(
                    request, metadata=metadata, timeout_s=deadline - self._clock.now()
                )
            except SluiceError as err:
                delay = self._retry_delay(err, attempt, deadline)
                if delay is None:
                    raise
                await self._sleep(delay)
                if self._clock.now() >= deadline:  # the sleep overslept: no time left for an attempt
                    err.add_note(f"gave up after {attempt} attempt(s): the deadline passed while waiting")
                    raise err from None
                continue
            return _result(response, attempt, self._clock.now() - start)

    def _retry_delay(self, err: SluiceError, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before the next attempt, or None to give up (noting why on the error)."""
        if not err.retryable:
            return None
        if attempt >= self._max_attempts:
            err.add_note(f"gave up after {attempt} attempt(s): max_attempts reached")
            return None
        delay = self.backoff(attempt, err.retry_after_s)
        now = self._clock.now()
        if now + delay >= deadline:
            err.add_note(f"gave up after {attempt} attempt(s): waiting {delay:.3f} s would pass the deadline")
            return None
        if not self._budget.try_withdraw(now):
            err.add_note(f"gave up after {attempt} attempt(s): retry budget exhausted")
            return None
        return delay

    def backoff(self, attempt: int, hint_s: float | None) -> float:
        """The jittered wait after failed attempt number `attempt` (1-based), given the server's hint."""
        if hint_s is not None and hint_s >= 0:
            return hint_s * self._rng.uniform(*HINT_JITTER)
        base: float = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2.0 ** (attempt - 1))
        return base * self._rng.uniform(*BACKOFF_JITTER)


class SyncSluiceClient:
    """A blocking facade over `SluiceClient` for scripts: it runs a private event loop in the calling thread.

    Not for use from inside a running event loop, nor from several threads at once.
    """

    def __init__(self, target: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(self._open(target, options))

    @staticmethod
    async def _open(target: str, options: dict[str, Any]) -> SluiceClient:
        return SluiceClient(target, **options)  # the channel binds to the loop it is created in

    def infer(self, model: str, inputs: Mapping[str, npt.NDArray[Any]], **options: Any) -> InferResult:
        """`SluiceClient.infer`, blocking."""
        return self._loop.run_until_complete(self._client.infer(model, inputs, **options))

    def close(self) -> None:
        """Close the channel and the private loop."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> SyncSluiceClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
