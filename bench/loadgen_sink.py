"""A sink KServe v2 server: it answers every ModelInfer at once with a canned response.

It measures the load generator itself (`sluice bench --ceiling`) and stands in for a router in the
generator's and the client's tests. Every model name is served, with one input `x` FP32 [-1, 16] and one
output `y` FP32 [-1, 16]; requests are not validated and no work is done, so what a benchmark against it
measures is the generator and the gRPC stack. `reject_every=k` answers every k-th request with a retryable
UNAVAILABLE (reason `queue_full`, hint 50 ms) instead, to exercise rejection accounting.

Run it alone with `python -m sluice_inference.bench.loadgen_sink [--port N]`; it prints
`listening on HOST:PORT` once bound and serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
import numpy as np

from sluice_inference.common.errors import Unavailable
from sluice_inference.common.grpc_errors import abort
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc

Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

SINK_DIMS = 16
SINK_SERVER_OPTIONS = (
    ("grpc.server.max_pending_requests", 1_000_000),
    ("grpc.server.max_pending_requests_hard_limit", 1_000_000),
)
"""gRPC core cancels calls (the client sees a bare CANCELLED) once too many wait for a Python handler; a
sink that falls behind should queue them instead, so the generator's figures are not mixed with refusals."""
SINK_REJECTION = Unavailable("sink: rejecting every k-th request", reason="queue_full", retry_after_s=0.05)


def canned_response(model: str = "sink") -> kserve.ModelInferResponse:
    """The one answer the sink gives: y = zeros, batch size 1, worker `sink`."""
    response = kserve.ModelInferResponse(model_name=model, model_version="1")
    response.outputs.add(name="y", datatype="FP32", shape=[1, SINK_DIMS])
    response.raw_output_contents.append(np.zeros((1, SINK_DIMS), "<f4").tobytes())
    response.parameters["sluice_batch_size"].int64_param = 1
    response.parameters["sluice_worker"].string_param = "sink"
    return response


class SinkServicer(kserve_grpc.GRPCInferenceServiceServicer):
    """`inference.GRPCInferenceService` that does nothing, quickly; counts the inference calls it saw."""

    def __init__(self, reject_every: int = 0) -> None:
        self.infer_calls = 0
        self._reject_every = reject_every
        self._response = canned_response()

    async def ServerLive(
        self, request: kserve.ServerLiveRequest, context: Context
    ) -> kserve.ServerLiveResponse:
        """Always live."""
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: kserve.ServerReadyRequest, context: Context
    ) -> kserve.ServerReadyResponse:
        """Always ready."""
        return kserve.ServerReadyResponse(ready=True)

    async def ModelReady(
        self, request: kserve.ModelReadyRequest, context: Context
    ) -> kserve.ModelReadyResponse:
        """Every model is ready."""
        return kserve.ModelReadyResponse(ready=True)

    async def ServerMetadata(
        self, request: kserve.ServerMetadataRequest, context: Context
    ) -> kserve.ServerMetadataResponse:
        """Names itself."""
        return kserve.ServerMetadataResponse(name="sluice-sink", version="0")

    async def ModelMetadata(
        self, request: kserve.ModelMetadataRequest, context: Context
    ) -> kserve.ModelMetadataResponse:
        """Any name: x FP32 [-1, 16] → y FP32 [-1, 16]."""
        response = kserve.ModelMetadataResponse(name=request.name, versions=["1"], platform="sink")
        response.inputs.add(name="x", datatype="FP32", shape=[-1, SINK_DIMS])
        response.outputs.add(name="y", datatype="FP32", shape=[-1, SINK_DIMS])
        return response

    async def ModelInfer(
        self, request: kserve.ModelInferRequest, context: Context
    ) -> kserve.ModelInferResponse:
        """The canned response (or, every `reject_every`-th call, a retryable rejection)."""
        self.infer_calls += 1
        if self._reject_every and self.infer_calls % self._reject_every == 0:
            await abort(context, SINK_REJECTION)
        return self._response

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[kserve.ModelInferRequest], context: Context
    ) -> AsyncIterator[kserve.ModelStreamInferResponse]:
        """One canned response per request, in order."""
        async for _ in request_iterator:
            self.infer_calls += 1
            yield kserve.ModelStreamInferResponse(infer_response=self._response)


class SinkServer:
    """The sink on a loopback port, in this process's event loop."""

    def __init__(self, servicer: kserve_grpc.GRPCInferenceServiceServicer | None = None) -> None:
        self.servicer = servicer or SinkServicer()
        self._server = grpc.aio.server(options=SINK_SERVER_OPTIONS)
        kserve_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, self._server)
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Bind and serve; returns `host:port` (port 0 picks a free one)."""
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        await self._server.start()
        return f"{host}:{self.port}"

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving (in-flight calls get `grace` seconds)."""
        await self._server.stop(grace)


async def _serve(host: str, port: int) -> None:
    server = SinkServer()
    addr = await server.start(host, port)
    print(f"listening on {addr}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    """`python -m sluice_inference.bench.loadgen_sink`: serve until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(description="A KServe v2 sink server that answers at once.")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
