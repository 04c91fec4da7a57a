"""The minimal path: a bare router and worker doing only the unavoidable work, with an oracle door.

The project's rule (issue 17): a goal may be declared out of reach only by measuring this path in the same
sitting; bench/minimal_two_tenant.py does, and says why its door is the floor of any door. Two processes,
no auth, quotas, metrics, tracing, lanes or estimators:
- the router serves `inference.GRPCInferenceService/ModelInfer` with grpc.aio through a generic handler
  whose request deserializer is the identity, so the body is parsed (the project's generated KServe
  messages) only once the door has let the call in; it queues the request's rows and answers when its
  slice of the batch's answer is back. `ModelMetadata` is answered too, because the load generator asks it
  once per class before a run;
- one grpc.aio bidi stream to the worker carries one message per batch each way, the rows concatenated;
  a batch is cut as soon as the worker is idle (one batch in flight), up to `MAX_BATCH` rows, so rows that
  arrive during a forward form the next batch; calls whose client gave up (deadline) are left out of it;
- the worker runs the synthetic model's shape, FP32 [rows, 16] in and out, with a trivial numpy forward
  (y = 2 x) that answers at once, as `synthetic` with base_ms = per_item_ms = 0 does; or, with
  `--model-file`, a TorchScript model run as Sluice's worker runs it (frozen for inference, one thread,
  `inference_mode`), with the router told its row widths (`--in-width`, `--out-width`);
- `--hold-ms` makes the router hold each batch as Triton's dynamic batcher does (until its oldest call has
  waited that long, or a full batch is queued) instead of cutting whenever the worker is idle: the floor
  of the shape with batches that fill, against which the per-core rate goals are judged
  (bench/peer_sitting.sh `MINIMAL_RATES` runs it through the peers' harness);
- both processes run on the event loop Sluice's own servers run on (common/event_loop.py), so the floor
  and Sluice are measured on one runtime.

The oracle door (`--door`): before the body is parsed, the router reads the call's `authorization`
metadata and refuses every `Bearer bronze-key` call at once, UNAVAILABLE with a retry pushback
(`grpc-retry-pushback-ms`) and the `sluice-reason` trailer Sluice's door sends (so the load report names
it a door refusal; bench/grpc_floor.py's `aio-refuse` sends the same two trailers). Any other call is
served. Without `--door` every call is served.

    python -m sluice_inference.bench.minimal_path --serve worker --port P [--core C] [--model-file F]
    python -m sluice_inference.bench.minimal_path --serve router --port Q --worker 127.0.0.1:P [--door]
        [--hold-ms H] [--in-width N --out-width M --output-name NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from sluice_inference.bench.calibration import one_row_request, process_cpu_s
from sluice_inference.bench.overload import BRONZE_KEY, GOLD_KEY
from sluice_inference.bench.two_tenant_overload import DOOR_REFUSAL
from sluice_inference.common.child_processes import Child
from sluice_inference.common.event_loop import run_server
from sluice_inference.common.local_cluster import free_port
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve

SERVICE = "inference.GRPCInferenceService"
WORKER_SERVICE, WORKER_METHOD = "minimal.Worker", "Batches"
MODEL, INPUT, OUTPUT, WIDTH = "synthetic", "x", "y", 16
FP32_BYTES = 4
MAX_BATCH = 32
BRONZE_AUTH, GOLD_AUTH = f"Bearer {BRONZE_KEY}", f"Bearer {GOLD_KEY}"
REFUSAL_TRAILERS = (("grpc-retry-pushback-ms", "100"), ("sluice-reason", DOOR_REFUSAL.split("/")[1]))
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0

Pending = tuple[bytes, "asyncio.Future[bytes]"]
"""A queued call: its rows, and the future its slice of the batch's answer is set on."""
Forward = Callable[[bytes], bytes]
"""A worker's model: a batch's FP32 rows in, its output rows out, both concatenated."""


@dataclass(frozen=True)
class Rows:
    """What one row of the served model is: FP32 widths in and out, and the output's name. A call's answer
    is its own byte range of the batch's answer."""

    in_width: int = WIDTH
    out_width: int = WIDTH
    output: str = OUTPUT

    @property
    def in_bytes(self) -> int:
        """Bytes of one input row."""
        return self.in_width * FP32_BYTES

    @property
    def out_bytes(self) -> int:
        """Bytes of one output row."""
        return self.out_width * FP32_BYTES


def _same(data: bytes) -> bytes:
    """The identity (de)serializer: bytes stay bytes, nothing is parsed."""
    return data


def forward(batch: bytes) -> bytes:
    """The worker's model: FP32 rows in, each doubled, the same rows out."""
    return (np.frombuffer(batch, "<f4") * np.float32(2)).astype("<f4", copy=False).tobytes()


def torchscript_forward(path: Path, in_width: int) -> Forward:
    """`path`'s TorchScript model as Sluice's worker runs it: frozen for inference (the backend's own
    `for_inference`), one thread, under `inference_mode`."""
    import torch

    from sluice_inference.worker.backends.torchscript import for_inference

    torch.set_num_threads(1)
    loaded: torch.jit.ScriptModule = torch.jit.load(str(path))  # type: ignore[no-untyped-call]
    module = for_inference(loaded.eval(), path)

    def run(batch: bytes) -> bytes:
        rows = np.frombuffer(batch, "<f4").reshape(-1, in_width)
        with torch.inference_mode():
            output: torch.Tensor = module(torch.from_numpy(rows))
        return bytes(output.numpy().astype("<f4", copy=False).tobytes())

    for rows in (1, MAX_BATCH):  # warm-up, as the worker's
        run(bytes(rows * in_width * FP32_BYTES))
    return run


def _batches(model: Forward) -> Callable[..., AsyncIterator[bytes]]:
    async def answer(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        async for batch in requests:
            yield model(batch)

    return answer


async def serve_worker(port: int, model: Forward = forward) -> None:
    """The worker process: one forward per stream message, answered on the same stream."""
    server = grpc.aio.server()
    handlers = {WORKER_METHOD: grpc.stream_stream_rpc_method_handler(_batches(model), _same, _same)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(WORKER_SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _metadata_response() -> kserve.ModelMetadataResponse:
    response = kserve.ModelMetadataResponse(name=MODEL, versions=["1"], platform="minimal")
    response.inputs.add(name=INPUT, datatype="FP32", shape=[-1, WIDTH])
    response.outputs.add(name=OUTPUT, datatype="FP32", shape=[-1, WIDTH])
    return response


class MinimalRouter:
    """The router's whole state: the queued calls, in arrival order, and the event that wakes the batcher.

    A call is either queued here or in the one batch in flight; its future is set when the batch's answer
    is back, or it was cancelled by grpc when its client gave up (then its rows are not sent). With a
    hold, `_since` holds each queued call's arrival and `_queued_rows` their rows."""

    def __init__(self, *, door: bool, rows: Rows = Rows(), hold_s: float = 0.0) -> None:
        self._door = door
        self._rows = rows
        self._hold_s = hold_s
        self._waiting: list[Pending] = []
        self._since: list[float] = []
        self._queued_rows = 0
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._metadata = _metadata_response()
        self._worker_ready = False

    def handlers(self) -> grpc.GenericRpcHandler:
        """ModelInfer on raw bytes (parsed after the door); ModelMetadata and ModelReady (the peers' load
        generator's readiness probe) on messages."""
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(self.infer, _same, _same),
            "ModelMetadata": grpc.unary_unary_rpc_method_handler(
                self.metadata,
                kserve.ModelMetadataRequest.FromString,
                kserve.ModelMetadataResponse.SerializeToString,
            ),
            "ModelReady": grpc.unary_unary_rpc_method_handler(
                self.ready, kserve.ModelReadyRequest.FromString, kserve.ModelReadyResponse.SerializeToString
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    async def ready(
        self, request: kserve.ModelReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kserve.ModelReadyResponse:
        """Ready once the channel to the worker is (the worker listens once its model is loaded)."""
        return kserve.ModelReadyResponse(ready=self._worker_ready)

    async def metadata(
        self, request: kserve.ModelMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> kserve.ModelMetadataResponse:
        """The one model's inputs and outputs, to anyone."""
        return self._metadata

    async def infer(self, body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        """Door, parse, queue, wait for the batch's answer, reply."""
        if self._door and ("authorization", BRONZE_AUTH) in (context.invocation_metadata() or ()):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "overloaded (oracle door)", trailing_metadata=REFUSAL_TRAILERS
            )
        request = kserve.ModelInferRequest.FromString(body)
        rows = request.raw_input_contents[0] if len(request.raw_input_contents) == 1 else b""
        shape = self._rows
        if not rows or len(rows) % shape.in_bytes or len(rows) > MAX_BATCH * shape.in_bytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"one FP32 [1..{MAX_BATCH}, {shape.in_width}] raw input expected",
            )
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()
        self._waiting.append((rows, answer))
        count = len(rows) // shape.in_bytes
        if self._hold_s:
            self._since.append(loop.time())
            self._queued_rows += count
            if self._queued_rows >= MAX_BATCH:
                self._full.set()
        self._wake.set()
        response = kserve.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name=shape.output, datatype="FP32", shape=[count, shape.out_width])
        response.raw_output_contents.append(await answer)
        return response.SerializeToString()

    async def hold(self) -> None:
        """Triton's timer, when the router holds: wait until the oldest queued call has waited `hold_s`,
        or a full batch is queued."""
        loop = asyncio.get_running_loop()
        while self._hold_s and self._waiting and self._queued_rows < MAX_BATCH:
            left = self._since[0] + self._hold_s - loop.time()
            if left <= 0:
                return
            self._full.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), left)

    def cut(self) -> list[Pending]:
        """Take the next batch off the queue: calls in arrival order up to `MAX_BATCH` rows, those whose
        client gave up dropped."""
        batch: list[Pending] = []
        rows = taken = queued = 0
        for pending in self._waiting:
            size = len(pending[0]) // self._rows.in_bytes
            if rows + size > MAX_BATCH:
                break
            taken += 1
            queued += size
            if not pending[1].cancelled():
                batch.append(pending)
                rows += size
        del self._waiting[:taken]
        if self._hold_s:
            del self._since[:taken]
            self._queued_rows -= queued
        return batch

    async def run_batches(self, worker: str) -> None:
        """The batcher: whenever calls are queued and the worker is idle, one message out, one back."""
        async with grpc.aio.insecure_channel(worker) as channel:
            await channel.channel_ready()
            self._worker_ready = True
            stream = channel.stream_stream(
                f"/{WORKER_SERVICE}/{WORKER_METHOD}", request_serializer=_same, response_deserializer=_same
            )(wait_for_ready=True)
            while True:
                if not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                await self.hold()
                batch = self.cut()
                if not batch:
                    continue
                await stream.write(b"".join(rows for rows, _ in batch))
                answer = await stream.read()
                if not isinstance(answer, bytes):  # grpc.aio.EOF
                    raise RuntimeError("the worker closed the batch stream")
                offset, shape = 0, self._rows
                for rows, future in batch:
                    size = len(rows) // shape.in_bytes * shape.out_bytes
                    if not future.done():
                        future.set_result(answer[offset : offset + size])
                    offset += size


async def serve_router(port: int, worker: str, *, door: bool, rows: Rows, hold_s: float) -> None:
    """The router process; it exits (the error raised) if its batcher fails, rather than hang calls."""
    router = MinimalRouter(door=door, rows=rows, hold_s=hold_s)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((router.handlers(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await asyncio.gather(server.wait_for_termination(), router.run_batches(worker))


@dataclass(frozen=True)
class MinimalPath:
    """A started router and worker: where the router listens, and both processes."""

    port: int
    router: Child
    worker: Child

    @property
    def target(self) -> str:
        """The router's address."""
        return f"127.0.0.1:{self.port}"

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds the router and the worker have used so far."""
        return process_cpu_s(self.router.process.pid), process_cpu_s(self.worker.process.pid)


async def wait_until_serving(path: MinimalPath, timeout_s: float, hold_s: float = 0.0) -> None:
    """Poll with one gold call until it is answered OK (the router up and its stream to the worker open),
    failing with the children's logs after `timeout_s` or when one of them has exited (`hold_s`: how long
    the router holds a lone call)."""
    request = one_row_request(MODEL, input_name=INPUT, width=WIDTH)
    until = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(path.target) as channel:
        infer = channel.unary_unary(
            f"/{SERVICE}/ModelInfer",
            request_serializer=kserve.ModelInferRequest.SerializeToString,
            response_deserializer=kserve.ModelInferResponse.FromString,
        )
        while time.monotonic() < until and path.router.alive() and path.worker.alive():
            try:
                await infer(request, timeout=1.0 + hold_s, metadata=(("authorization", GOLD_AUTH),))
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
    logs = "\n".join(
        f"--- {c.name}:\n{c.log_path.read_text(errors='replace')[-2000:]}"
        for c in (path.router, path.worker)
        if c.log_path is not None and c.log_path.exists()
    )
    raise RuntimeError(f"the minimal path did not serve within {timeout_s:g} s\n{logs}")


@contextlib.contextmanager
def running_minimal_path(
    *, door: bool, core: int | None, log_dir: Path, hold_ms: float = 0.0
) -> Iterator[MinimalPath]:
    """Worker and router started on free loopback ports (on `core` when given; the router holding each
    batch `hold_ms`) and serving; both stopped on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "sluice_inference.bench.minimal_path"]
    pinning = [] if core is None else ["--core", str(core)]
    worker_port, port = free_port(), free_port()
    children: list[Child] = []
    try:
        children.append(Child("worker", [*command, "--serve", "worker", "--port", str(worker_port), *pinning],
                              log_dir))  # fmt: skip
        router_argv = [
            *command,
            "--serve",
            "router",
            "--port",
            str(port),
            "--worker",
            f"127.0.0.1:{worker_port}",
        ]
        router_argv += [*pinning, "--hold-ms", str(hold_ms), *(["--door"] if door else [])]
        children.append(Child("router", router_argv, log_dir))
        path = MinimalPath(port, router=children[1], worker=children[0])
        asyncio.run(wait_until_serving(path, READY_TIMEOUT_S, hold_ms / 1000))
        yield path
    finally:
        for child in children:
            child.stop(STOP_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    """Run the router or the worker until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=("router", "worker"), required=True)
    parser.add_argument("--port", type=int, required=True, help="listen on 127.0.0.1:PORT")
    parser.add_argument("--worker", default="", help="the router's worker, HOST:PORT")
    parser.add_argument("--door", action="store_true", help="the router refuses every bronze call")
    parser.add_argument("--core", type=int, help="pin the process to this core")
    parser.add_argument("--hold-ms", type=float, default=0.0, help="the router holds each batch this long")
    parser.add_argument("--model-file", type=Path, help="the worker runs this TorchScript model")
    parser.add_argument("--in-width", type=int, default=WIDTH, help="FP32 values in one input row")
    parser.add_argument("--out-width", type=int, default=WIDTH, help="FP32 values in one output row")
    parser.add_argument("--output-name", default=OUTPUT, help="the output's name in answers")
    args = parser.parse_args(argv)
    if args.serve == "router" and not args.worker:
        parser.error("a router needs --worker")
    if not 0 <= args.hold_ms <= 1000 or min(args.in_width, args.out_width) < 1:
        parser.error("--hold-ms lies in 0..1000 and widths are positive")
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})  # before grpc starts its threads, which inherit it
    if args.serve == "worker":
        model = forward if args.model_file is None else torchscript_forward(args.model_file, args.in_width)
        run_server(serve_worker(args.port, model))
    else:
        rows, hold_s = Rows(args.in_width, args.out_width, args.output_name), args.hold_ms / 1000
        run_server(serve_router(args.port, args.worker, door=args.door, rows=rows, hold_s=hold_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
