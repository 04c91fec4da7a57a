"""The floor under the router → worker hop: CPU per exchange on one grpc.aio bidi stream, both ends, with no
work at all — one message of `--bytes` each way, as a batch and its answer are.

A client (this process) writes a message and reads the echo, `--exchanges` times after a warm-up, over TCP
loopback and over a Unix-domain socket (gRPC's `unix:` target, the design's option for a co-located
worker); the client's CPU is `time.process_time`, the echo server's (a child process) from /proc. Both are
pinned to one core, as the peer sittings pin a whole Sluice, and run on the event loop the router and
worker run on (common/event_loop.py: `SLUICE_EVENT_LOOP=asyncio` for asyncio's own).

    python -m sluice_inference.bench.stream_floor [--bytes 8000] [--exchanges 4000] [--core 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sluice_inference.bench.calibration import process_cpu_s
from sluice_inference.common.event_loop import run_server
from sluice_inference.common.local_cluster import free_port

METHOD = "/floor.Echo/Stream"
READY_TIMEOUT_S = 60.0
"""How long the client waits for the echo server's process to start listening."""


def _ident(body: bytes) -> bytes:
    return body


async def _serve(target: str) -> None:
    async def echo(requests: AsyncIterator[bytes], _context: Any) -> AsyncIterator[bytes]:
        async for message in requests:
            yield message

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo, _ident, _ident)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("floor.Echo", {"Stream": handler}),)
    )
    server.add_insecure_port(target)
    await server.start()
    await server.wait_for_termination()


async def _exchange(target: str, size: int, exchanges: int, server_pid: int) -> tuple[float, float]:
    """(client, server) CPU seconds per exchange, measured after a warm-up."""
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), READY_TIMEOUT_S)  # the child server is starting
        call = channel.stream_stream(METHOD, request_serializer=_ident, response_deserializer=_ident)()
        message = b"x" * size
        for _ in range(max(100, exchanges // 20)):
            await call.write(message)
            await call.read()
        start, server_start = time.process_time(), process_cpu_s(server_pid)
        for _ in range(exchanges):
            await call.write(message)
            await call.read()
        client, server = time.process_time() - start, process_cpu_s(server_pid) - server_start
        call.cancel()
        return client / exchanges, server / exchanges


def measure(target: str, size: int, exchanges: int, core: int) -> tuple[float, float]:
    """(client, server) CPU seconds per exchange over `target`."""
    child = subprocess.Popen(
        [sys.executable, "-m", "sluice_inference.bench.stream_floor", "--serve", target, "--core", str(core)]
    )
    cores = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})
        return run_server(_exchange(target, size, exchanges, child.pid))
    finally:
        os.sched_setaffinity(0, cores)
        child.kill()
        child.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=8000, help="message size each way (default 8000)")
    parser.add_argument("--exchanges", type=int, default=4000)
    parser.add_argument("--core", type=int, default=0, help="the core both ends are pinned to")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        os.sched_setaffinity(0, {args.core})
        run_server(_serve(args.serve))
        return
    with tempfile.TemporaryDirectory() as folder:
        for name, target in (
            ("tcp loopback", f"127.0.0.1:{free_port()}"),
            ("unix socket", f"unix:{folder}/floor.sock"),
        ):
            client, server = measure(target, args.bytes, args.exchanges, args.core)
            print(
                f"{name}: {args.bytes} bytes each way: client {client * 1e6:.0f} µs, "
                f"server {server * 1e6:.0f} µs of CPU per exchange"
            )


if __name__ == "__main__":
    main()
