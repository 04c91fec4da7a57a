"""The open-loop load generator behind `sluice bench SCENARIO.yaml` (docs/loadgen.md).

Rules:
1. Arrivals follow a schedule fixed before the run (`sluice_inference.bench.loadgen_schedule`). The scheduler
   starts each request as its own task and never awaits it, so a slow answer cannot delay a later arrival (no
   coordinated omission); how late each send was against its schedule is measured (the send lag).
2. Every scheduled request ends in exactly one `RequestRecord`: OK, the gRPC status it got, or
   CLIENT_ERROR if the generator itself could not send it.
3. No retries: the generator measures the server, and a retry would change the load it offers.
4. Payloads are built once at start from each model's metadata; requests reuse them, so per-request work
   is the RPC alone.
"""

from __future__ import annotations

import asyncio
import bisect
import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from sluice_inference.bench.loadgen_scenario import Scenario, TrafficClass
from sluice_inference.bench.loadgen_schedule import Schedule, build_schedule, random_streams
from sluice_inference.bench.loadgen_stats import ClassLabel, RequestRecord, summarize
from sluice_inference.common.client import channel_options
from sluice_inference.common.grpc_errors import PUSHBACK_KEY, REASON_KEY, from_rpc_error
from sluice_inference.common.heap import frozen_heap
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from sluice_inference.common.tensors import dtype_of

EXIT_CONNECTION, EXIT_RPC = 2, 3
LEAD_S = 0.05
"""The schedule starts this long after setup, so the first arrivals are not late by construction."""
DRAIN_GRACE_S = 5.0
"""After the last arrival, requests get their deadline plus this long to answer before they are abandoned."""
LAG_WARNING_S = 0.005
"""Above this p99 send lag the generator, not the server, may be shaping the figures."""
Metadata = tuple[tuple[str, str], ...]


class LoadgenError(Exception):
    """The run could not start; `exit_code` follows the CLI (2 no connection, 3 RPC failure)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class ClassPlan:
    """Everything needed to send one class's requests, built once."""

    variants: list[kserve.ModelInferRequest]
    metadata: Metadata
    deadline_s: float
    cumulative: list[float] | None = None
    """Cumulative draw probabilities of the variants (Zipf); None: uniform."""

    def pick(self, draw: float) -> kserve.ModelInferRequest:
        """The variant a uniform draw in [0, 1) selects."""
        if self.cumulative is None:
            return self.variants[int(draw * len(self.variants))]
        return self.variants[min(len(self.variants) - 1, bisect.bisect_right(self.cumulative, draw))]


def random_tensor(dtype: np.dtype[Any], shape: list[int], rng: np.random.Generator) -> npt.NDArray[Any]:
    """Random values of `dtype`: normal floats, small positive integers, or booleans."""
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(1, 100, size=shape).astype(dtype)
    return rng.integers(0, 2, size=shape).astype(dtype)


def plan_class(cls: TrafficClass, meta: kserve.ModelMetadataResponse, rng: np.random.Generator) -> ClassPlan:
    """The class's request variants (`payloads` random payloads per length), metadata and deadline."""
    variants = []
    for length in cls.lengths:
        for _ in range(cls.payloads):
            request = kserve.ModelInferRequest(model_name=cls.model, model_version=cls.version)
            for tensor in meta.inputs:
                shape = [cls.rows] + [length if d < 0 else d for d in tensor.shape[1:]]
                data = random_tensor(dtype_of(tensor.datatype, tensor=tensor.name), shape, rng)
                request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=shape)
                request.raw_input_contents.append(data.tobytes())
            if cls.priority:
                request.parameters["priority"].int64_param = cls.priority
            request.parameters["timeout"].int64_param = round(cls.deadline_ms * 1000)
            if cls.cache is not None:
                request.parameters["cache"].bool_param = cls.cache
            variants.append(request)
    metadata = () if cls.tenant_key is None else (("authorization", f"Bearer {cls.tenant_key}"),)
    cumulative = None
    if cls.zipf is not None:
        weights = np.tile(1.0 / np.arange(1, cls.payloads + 1) ** cls.zipf, len(cls.lengths))
        cumulative = (np.cumsum(weights) / weights.sum()).tolist()
    return ClassPlan(variants, metadata, cls.deadline_ms / 1000.0, cumulative)


def rejection(exc: grpc.aio.AioRpcError) -> tuple[str, str, bool]:
    """Status name, `sluice-reason`, and whether a retry hint came with a failed call."""
    trailers = dict(exc.trailing_metadata() or ())
    pushback = trailers.get(PUSHBACK_KEY)
    hint = from_rpc_error(exc).retry_after_s is not None or (pushback is not None and pushback != "-1")
    reason = trailers.get(REASON_KEY, "")
    return exc.code().name, reason if isinstance(reason, str) else "", hint


async def open_channels(target: str, count: int, timeout_s: float) -> list[grpc.aio.Channel]:
    """`count` connected channels, each on its own TCP connection; LoadgenError if none connects in time."""
    options = channel_options(target, [("grpc.use_local_subchannel_pool", 1)])  # no shared connection
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(count)]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels)), timeout_s)
    except TimeoutError:
        await asyncio.gather(*(c.close() for c in channels))
        raise LoadgenError(f"cannot connect to {target} within {timeout_s:g} s", EXIT_CONNECTION) from None
    return channels


async def fetch_metadata(
    stub: kserve_grpc.GRPCInferenceServiceAsyncStub, scenario: Scenario
) -> dict[tuple[str, str], kserve.ModelMetadataResponse]:
    """ModelMetadata once per (model, version, key) the scenario uses, asked with each class's key (a router
    that requires keys answers metadata only to tenants allowed to call the model), so a key the target
    does not know fails the run before it starts, naming the config that has it."""
    found = {}
    asked: set[tuple[str, str, str | None]] = set()
    for cls in scenario.classes:
        if (cls.model, cls.version, cls.tenant_key) in asked:
            continue
        asked.add((cls.model, cls.version, cls.tenant_key))
        auth = () if cls.tenant_key is None else (("authorization", f"Bearer {cls.tenant_key}"),)
        try:
            found[(cls.model, cls.version)] = await stub.ModelMetadata(
                kserve.ModelMetadataRequest(name=cls.model, version=cls.version), timeout=10, metadata=auth
            )
        except grpc.aio.AioRpcError as exc:
            raise _metadata_error(exc, scenario, cls) from None
    return found


def _metadata_error(exc: grpc.aio.AioRpcError, scenario: Scenario, cls: TrafficClass) -> LoadgenError:
    """Why the run cannot start, with what to do when the target does not know a class's key."""
    code = EXIT_CONNECTION if exc.code() == grpc.StatusCode.UNAVAILABLE else EXIT_RPC
    where = cls.model + (f" version {cls.version}" if cls.version else "")
    message = f"model metadata for {where}: {exc.code().name}: {exc.details()}"
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        fix = (
            f"start the cluster with the scenario's tenants: sluice up --config {scenario.cluster_config} "
            f"(or make run RUN_ARGS='--config {scenario.cluster_config}')"
            if scenario.cluster_config
            else "add a tenant with that key to the cluster's config (`sluice keys hash KEY` prints its hash)"
        )
        message += f"\nthe target does not know class {cls.name!r}'s tenant_key {cls.tenant_key!r}: {fix}"
    return LoadgenError(message, code)


class _Run:
    """One pass over a schedule: fires each request at its time and keeps exactly one record per request."""

    def __init__(
        self,
        schedule: Schedule,
        plans: Sequence[ClassPlan],
        stubs: Sequence[kserve_grpc.GRPCInferenceServiceAsyncStub],
    ) -> None:
        self._schedule = schedule
        self._plans = plans
        self._stubs = stubs
        self.records: list[RequestRecord | None] = [None] * len(schedule)
        self._loop = asyncio.get_running_loop()
        self._t0 = 0.0

    async def fire_all(self) -> list[RequestRecord]:
        """Run the schedule, wait for every answer (or abandon it after its deadline plus a grace)."""
        times = self._schedule.times_s.tolist()
        classes = self._schedule.classes.tolist()
        draws = self._schedule.variant_draws.tolist()
        tasks: set[asyncio.Task[None]] = set()
        self._t0 = self._loop.time() + LEAD_S
        i, n = 0, len(times)
        while i < n:
            now = self._loop.time()
            if self._t0 + times[i] > now:
                await asyncio.sleep(self._t0 + times[i] - now)
                continue
            while i < n and self._t0 + times[i] <= now:  # everything due: start it, then yield once
                task = self._loop.create_task(self._send(i, times[i], classes[i], draws[i]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            await asyncio.sleep(0)
        await self._drain(tasks)
        return [r for r in self.records if r is not None]

    async def _drain(self, tasks: set[asyncio.Task[None]]) -> None:
        if not tasks:
            return
        longest = max(p.deadline_s for p in self._plans)
        _, pending = await asyncio.wait(set(tasks), timeout=longest + DRAIN_GRACE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _send(self, i: int, due_s: float, cls: int, draw: float) -> None:
        start = self._loop.time()
        plan = self._plans[cls]
        request = plan.pick(draw)
        code, reason, hint, detail, cache = "OK", "", False, "", ""
        try:
            response = await self._stubs[i % len(self._stubs)].ModelInfer(
                request, metadata=plan.metadata, timeout=plan.deadline_s
            )
            cache = response.parameters["sluice_cache"].string_param
        except grpc.aio.AioRpcError as exc:
            code, reason, hint = rejection(exc)
            detail = exc.details() or ""
        except asyncio.CancelledError:
            code, reason = "CLIENT_ERROR", "abandoned"
            raise
        except Exception as exc:  # the generator's own failure is still this request's one outcome
            code, reason, detail = "CLIENT_ERROR", type(exc).__name__, str(exc)
        finally:
            end = self._loop.time()
            self.records[i] = RequestRecord(
                cls=cls, scheduled_s=due_s, lag_s=start - (self._t0 + due_s), latency_s=end - start,
                code=code, deadline_s=plan.deadline_s, reason=reason, hint=hint, detail=detail, cache=cache,
            )  # fmt: skip


def labels(scenario: Scenario) -> list[ClassLabel]:
    """Report labels of the scenario's classes."""
    return [ClassLabel(c.name, c.tenant_label, c.priority, c.model) for c in scenario.classes]


async def run_scenario(scenario: Scenario, *, connect_timeout_s: float = 10.0) -> dict[str, Any]:
    """Run a scenario against its target and return the report
    (`sluice_inference.bench.loadgen_stats.summarize` + context)."""
    channels = await open_channels(scenario.target, scenario.channels, connect_timeout_s)
    try:
        stubs = [kserve_grpc.GRPCInferenceServiceStub(c) for c in channels]
        metadata = await fetch_metadata(stubs[0], scenario)
        payload_rng = random_streams(scenario.seed)[3]
        plans = [plan_class(c, metadata[(c.model, c.version)], payload_rng) for c in scenario.classes]
        schedule = build_schedule(scenario)
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        with frozen_heap(collect=True):  # setup objects leave the collector's view: shorter pauses in the run
            records = await _Run(schedule, plans, stubs).fire_all()
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    report = summarize(records, labels(scenario), scenario.duration_s)
    report.update(scheduled=len(schedule), started_at=started, scenario=scenario.model_dump(mode="json"))
    report["warnings"] = warnings(report)
    return report


def warnings(report: dict[str, Any]) -> list[str]:
    """What makes the figures suspect: a generator behind its schedule, or requests never answered."""
    found = []
    lag = report["send_lag_ms"]["p99"]
    if lag is not None and lag > LAG_WARNING_S * 1000:
        found.append(
            f"send lag p99 {lag:.1f} ms > {LAG_WARNING_S * 1000:g} ms: the generator fell behind its "
            "schedule, so it offered less load than asked and its latency and late-OK figures include its "
            "own delays; give it more CPU (see `sluice bench --ceiling`)"
        )
    abandoned = report["total"]["rejected_by_status"].get("CLIENT_ERROR/abandoned", 0)
    if abandoned:
        found.append(f"{abandoned} request(s) got no answer by their deadline + {DRAIN_GRACE_S:g} s")
    return found
