"""The floor under any Python gRPC server on this machine: server CPU per unary call with no work at all.

A server process (pinned to one core) answers `ModelInfer` with raw bytes, in one of these modes:
`aio-ok` (grpc.aio, echo the body), `aio-gated` (grpc.aio in the shape of the router's receive gate,
router/receive_gate.py: the method is served by a request-streaming handler, with no server interceptor,
which reads the body itself with `context.read()` under a per-call timer, then echoes it), `aio-refuse`
(grpc.aio, refuse with UNAVAILABLE and trailers, as the front door does), `sync-ok` (the thread-pool
server, echo). The aio modes run on the event loop the router and worker run on (common/event_loop.py:
`SLUICE_EVENT_LOOP=asyncio` for asyncio's own). An open-loop client pinned to another core sends
`--rate` calls per second for `--seconds`; the server's CPU over that window divided by the calls is the
figure. `--hog-ms` makes every turn of the aio server's event loop also spend that long in one callback
(what other work in the router's loop does to the calls): it shows how the rate a grpc.aio server takes
calls in falls with the length of its loop turns.

    python -m sluice_inference.bench.grpc_floor --mode aio-ok --rate 1500 --seconds 6
    python -m sluice_inference.bench.grpc_floor --mode aio-gated --rate 1000 --seconds 5
    python -m sluice_inference.bench.grpc_floor --mode aio-ok --rate 800 --seconds 5 --hog-ms 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from concurrent import futures
from typing import Any

import grpc

from sluice_inference.bench.calibration import process_cpu_s
from sluice_inference.common.event_loop import run_server
from sluice_inference.common.local_cluster import free_port

SERVICE, METHOD = "inference.GRPCInferenceService", "ModelInfer"
TRAILERS = (("grpc-retry-pushback-ms", "100"), ("sluice-reason", "router_overloaded"))
CHANNELS = 4
BODY = b"x" * 1100
"""About one FP32 [1, 256] request."""
GATED_RECEIVE_S = 5.0
"""`aio-gated`: the per-call timer on the body's arrival (the router's `receive_timeout_s`)."""


async def _aio_server(port: int, refuse: bool, gated: bool, hog_s: float) -> None:
    async def handler(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        if refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded", trailing_metadata=TRAILERS)
        return body

    loop = asyncio.get_running_loop()

    async def read_then_echo(_requests: Any, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        task = asyncio.current_task()
        assert task is not None
        timer = loop.call_later(GATED_RECEIVE_S, task.cancel)
        try:
            body: bytes = await context.read()
        finally:
            timer.cancel()
        return body

    def hog() -> None:
        time.sleep(hog_s)
        loop.call_soon(hog)

    if hog_s:
        loop.call_soon(hog)
    server = grpc.aio.server()
    methods: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        METHOD: grpc.stream_unary_rpc_method_handler(read_then_echo)
        if gated
        else grpc.unary_unary_rpc_method_handler(handler)
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _sync_server(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    methods: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        METHOD: grpc.unary_unary_rpc_method_handler(lambda body, context: body)
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve(mode: str, port: int, hog_s: float) -> None:
    """Run one server until killed (the child process)."""
    if mode == "sync-ok":
        _sync_server(port)
    else:
        run_server(_aio_server(port, mode == "aio-refuse", mode == "aio-gated", hog_s))


async def load(port: int, rate: float, seconds: float) -> dict[str, Any]:
    """Open-loop calls at `rate`; outcome counts and the OK latencies' p50 and p99 (ms)."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(CHANNELS)]
    calls: list[grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = [
        c.unary_unary(f"/{SERVICE}/{METHOD}") for c in channels
    ]
    codes: dict[str, int] = {}
    latencies: list[float] = []

    async def one(index: int) -> None:
        started = time.perf_counter()
        try:
            await calls[index % CHANNELS](BODY, timeout=2)
            latencies.append(time.perf_counter() - started)
            code = "OK"
        except grpc.aio.AioRpcError as err:
            code = err.code().name
        codes[code] = codes.get(code, 0) + 1

    start = time.perf_counter()
    tasks = []
    for index in range(int(rate * seconds)):
        delay = start + index / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index)))
    await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    latencies.sort()
    p50, p99 = _percentile_ms(latencies, 0.5), _percentile_ms(latencies, 0.99)
    return {"codes": codes, "p50_ms": p50, "p99_ms": p99}


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("aio-ok", "aio-gated", "aio-refuse", "sync-ok"), default="aio-ok")
    parser.add_argument("--rate", type=float, default=1500)
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--hog-ms", type=float, default=0.0)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_port:
        os.sched_setaffinity(0, {args.server_core})
        serve(args.mode, args.serve_port, args.hog_ms / 1000)
        return
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "sluice_inference.bench.grpc_floor", "--mode", args.mode, "--hog-ms",
         str(args.hog_ms), "--server-core", str(args.server_core), "--serve-port", str(port)]
    )  # fmt: skip
    try:
        os.sched_setaffinity(0, {args.client_core})
        time.sleep(1.5)
        before = process_cpu_s(child.pid)
        result = asyncio.run(load(port, args.rate, args.seconds))
        used = process_cpu_s(child.pid) - before
    finally:
        child.kill()
        child.wait(10)
    calls = sum(result["codes"].values())
    print(
        f"{args.mode} at {args.rate:.0f}/s (hog {args.hog_ms} ms): "
        f"server CPU {used / calls * 1e6:.0f} µs per call, outcomes {result['codes']}, "
        f"OK p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms"
    )


if __name__ == "__main__":
    main()
