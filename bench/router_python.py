"""The router's own Python per request, in one process and without gRPC: a noise-free yardstick for the
work between a parsed `ModelInferRequest` and its response (issue 17).

A `RouterServer` is built but not started (no ports, no etcd). One fake worker link answers every batch
at once: its reply is serialized and parsed as the stream would carry it, so the router's split of the
answer is real. Each round hands `--concurrency` copies of one FP32 [1, 256] request to
`InferenceServicer.infer_from_head` at once (the door and the receive gate ran before it in a real
router; the gRPC call itself is not here), waits for every answer and serializes it. The thread's CPU
time over the measured rounds divided by the requests is the figure: the servicer, the data plane
(authentication in key-less mode, budgets, validation, cache and idempotency gates), the driver and the
policy core (admission, queueing, batching, dispatch, settling), and the asyncio tasks and futures they
use. What this leaves out, measured in the harness instead (docs/performance.md): gRPC's per-call work,
the receive gate's shape, the worker stream's messages and the worker itself.

The rounds run under a router process's collector settings (common/heap.py): the heap built so far
frozen, young collections every `YOUNG_THRESHOLD` allocations. Under CPython's defaults, as this ran until
2026-12-05, full collections scanned the whole heap, so a change that allocated a few objects fewer per
request looked ~8 µs cheaper here than it is in a router.

With `--refused` the tenant is over its rate (one token, then none for days), so every measured request is
refused RESOURCE_EXHAUSTED by admission, after decoding, validation and the cache's lookup, as a quota
refusal is: the router's Python per refused request, against the figure above per served one.

    python -m sluice_inference.bench.router_python [--concurrency 20] [--rounds 300] [--repeats 5]
        [--refused] [--profile N]   (cProfile's N most costly functions by own time, after the rounds)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import pstats
import time
from dataclasses import dataclass
from typing import NoReturn

import grpc
import numpy as np

from sluice_inference.common.batch_tensors import pack_arrays
from sluice_inference.common.clock import MonotonicClock
from sluice_inference.common.cluster_auth import ClusterClient
from sluice_inference.common.config import SluiceConfig
from sluice_inference.common.heap import YOUNG_THRESHOLD, frozen_heap, young_collections_every
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.sluice.v1 import worker_pb2
from sluice_inference.common.records import ModelRecord, TensorSpec, WorkerRecord
from sluice_inference.common.serving_settings import ANONYMOUS_TENANT, TenantSettings
from sluice_inference.common.trust_settings import ClusterSettings
from sluice_inference.router.driver import Driver
from sluice_inference.router.kserve_codec import read_head
from sluice_inference.router.main import RouterServer
from sluice_inference.router.worker_link import WorkerLink

FEATURES, OUTPUTS = 256, 10
"""The peers' MLP: FP32 [256] in, [10] out."""
RECORD = ModelRecord(
    name="mlp",
    version="1",
    digest="sha256:router-python",
    platform="torchscript",
    max_batch_size=32,
    max_wait_s=0.005,
    inputs=(TensorSpec(name="x", datatype="FP32", dims=(FEATURES,)),),
    outputs=(TensorSpec(name="output", datatype="FP32", dims=(OUTPUTS,)),),
)
WORKER = "w1"
WARMUP_ROUNDS = 100
OVER_RATE = TenantSettings(rate=1e-6, burst=1, max_inflight=1_000_000)
"""`--refused`'s tenant: its one token goes in the warm-up, the next comes in eleven days."""


class AnsweringLink(WorkerLink):
    """A worker stream's router end that answers each batch at once with zeros, through the wire format."""

    def __init__(self, driver: Driver) -> None:
        super().__init__(
            WORKER,
            "unused:0",
            on_message=lambda *_: None,
            on_up=lambda *_: None,
            on_closed=lambda *_: None,
            cluster=ClusterClient(ClusterSettings()),
            clock=MonotonicClock(),
        )
        self._driver = driver

    def send(self, message: worker_pb2.RouterMessage) -> bool:
        """Answer the message's batches on the next loop turn, as a worker's reply would arrive."""
        message.SerializeToString()  # what the real link's stream does with it
        if message.batches:
            results = [_result(batch) for batch in message.batches]
            wire = worker_pb2.WorkerMessage(results=results).SerializeToString()
            asyncio.get_running_loop().call_soon(
                self._driver.on_message, WORKER, worker_pb2.WorkerMessage.FromString(wire)
            )
        return True


def _result(batch: worker_pb2.Batch) -> worker_pb2.BatchResult:
    rows = list(batch.item_rows)
    output = np.zeros((sum(rows), OUTPUTS), "<f4")
    return worker_pb2.BatchResult(
        batch_id=batch.batch_id,
        executed_size=sum(rows),
        item_ids=batch.item_ids,
        item_rows=rows,
        outputs=[pack_arrays("output", [output])],
    )


class Aborted(Exception):
    """`_Context.abort`: the call ended with a status, as grpc.aio's abort ends a handler."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code)
        self.code = code


class _Context:
    """What the servicer asks of a gRPC call's context."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> NoReturn:
        raise Aborted(code)

    def time_remaining(self) -> float:
        return 2.0

    def invocation_metadata(self) -> tuple[()]:
        return ()


@dataclass(frozen=True)
class Figures:
    """CPU µs per request in each measured repeat, rows per batch, and answers that were not right (with
    `refused`: every one not refused RESOURCE_EXHAUSTED)."""

    us_per_request: list[float]
    rows_per_batch: float
    wrong: int


def _server(refused: bool) -> RouterServer:
    """A router, not started, whose driver runs and has one worker: the answering link."""
    server = RouterServer(SluiceConfig(tenants={ANONYMOUS_TENANT: OVER_RATE}) if refused else SluiceConfig())
    driver = server.driver
    record = WorkerRecord(
        worker_id=WORKER, addr="127.0.0.1:1", device="cpu", models=(RECORD,), capacity=2, state="ready",
        started_at=0.0,
    )  # fmt: skip
    server.catalog.update({WORKER: record})
    server.links.add(AnsweringLink(driver))
    driver.worker_registered(WORKER, {(RECORD.name, RECORD.version): {}}, 2, True, "cpu")
    driver.worker_connected(WORKER, True)
    driver.start()
    return server


async def measure(
    concurrency: int, rounds: int, repeats: int, profile: int = 0, *, refused: bool = False
) -> Figures:
    """Run the rounds (after a warm-up) and return the figures; `profile` > 0 prints cProfile's top;
    `refused`: the tenant is over its rate, so every measured request is refused."""
    server = _server(refused)
    driver = server.driver
    servicer = server.inference_servicer()
    request = kserve.ModelInferRequest(model_name=RECORD.name)
    request.inputs.add(name="x", datatype="FP32", shape=[1, FEATURES])
    request.raw_input_contents.append(np.arange(FEATURES, dtype="<f4").tobytes())
    body = request.SerializeToString()
    expected = np.zeros(OUTPUTS, "<f4").tobytes()
    wrong = 0

    async def one() -> None:
        nonlocal wrong
        context = _Context()
        parsed = kserve.ModelInferRequest.FromString(body)
        try:
            response = await servicer.infer_from_head(parsed, context, read_head(()), len(body))  # type: ignore[arg-type]
        except Aborted as aborted:
            wrong += not refused or aborted.code is not grpc.StatusCode.RESOURCE_EXHAUSTED
            return
        wrong += refused
        response.SerializeToString()  # the answer's hold ends with this task, as with a call's in gRPC
        if list(response.raw_output_contents) != [expected]:
            wrong += 1

    async def run(count: int) -> None:
        for _ in range(count):
            await asyncio.gather(*[one() for _ in range(concurrency)])

    try:
        with frozen_heap(collect=True), young_collections_every(YOUNG_THRESHOLD):
            await run(WARMUP_ROUNDS)
            if refused:
                wrong = 0  # the tenant's one token served one warm-up request
            figures = []
            for _ in range(repeats):
                start = time.thread_time()
                await run(rounds)
                figures.append((time.thread_time() - start) / (rounds * concurrency) * 1e6)
            if profile:
                profiler = cProfile.Profile()
                profiler.enable()
                await run(rounds)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    finally:
        await driver.stop()
    registry = server.metrics.registry
    rows = registry.get_sample_value("sluice_router_batch_size_sum", {"model": RECORD.name}) or 0.0
    batches = registry.get_sample_value("sluice_router_batch_size_count", {"model": RECORD.name}) or 1.0
    return Figures(figures, rows / batches, wrong)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=20, help="requests handed over at once")
    parser.add_argument("--rounds", type=int, default=300, help="rounds per measured repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--refused", action="store_true", help="the tenant is over its rate: all refused")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N")
    args = parser.parse_args()
    logging.getLogger("sluice_inference").setLevel(logging.ERROR)  # key-less local mode warns at build
    figures = asyncio.run(
        measure(args.concurrency, args.rounds, args.repeats, args.profile, refused=args.refused)
    )
    runs = ", ".join(f"{value:.1f}" for value in figures.us_per_request)
    what = "refused request" if args.refused else "request"
    batches = "" if args.refused else f", {figures.rows_per_batch:.1f} rows a batch"
    print(
        f"router Python per {what}: {min(figures.us_per_request):.1f} µs CPU (best of {args.repeats}: "
        f"{runs}), {args.concurrency} at once{batches}, {figures.wrong} wrong answers"
    )


if __name__ == "__main__":
    main()
