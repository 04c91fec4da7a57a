"""How much load this machine's router path takes now: the measurement load-shaped tests start from.

A test that offers an absolute rate tests a different regime on a slower core: a rate that leaves the
router idle most of the time here can saturate it there, and then the router, not the worker or the
policy under test, decides the outcome. So such a test first measures, on the machine it runs on and
with whatever else shares the cores at that moment, what its router path serves flat out, and derives
its rates from that figure (`scale_for`).

The measurement (`measure_router`): a closed loop of `concurrency` callers sends one-row requests to a
router whose worker answers at once, for `duration_s` after a warm-up. What comes out per second is the
rate at which the generator, the router and the worker, sharing this machine's CPU as they do in the
test, turn requests around when the router path is the limit (`rps`). It is counted over the slowest
quarter of the time: the CPU left to them varies while other work runs, and a test lives through the lean
moments too. The router's CPU time over the same time, read from /proc, gives its cost per request
(`router_cpu_ms`): reported, and the figure a reader compares across machines, but not what rates are
derived from, because a CPU quota or a busy neighbour leaves the cost per request unchanged while taking
the core away; the throughput sees both.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass

import grpc
import numpy as np

from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve
from sluice_inference.common.pb.inference import grpc_service_pb2_grpc as kserve_grpc

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
Metadata = tuple[tuple[str, str], ...]


def process_cpu_s(pid: int, *, reaped: bool = False) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far, from /proc/<pid>/stat; with
    `reaped`, also what its exited children used once it waited for them."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        # Fields after the parenthesised command name (which may hold spaces): utime and stime are the
        # 12th and 13th of them, cutime and cstime (waited-for children) the 14th and 15th.
        fields = stat.read().rsplit(")", 1)[1].split()
    used = int(fields[11]) + int(fields[12])
    if reaped:
        used += int(fields[13]) + int(fields[14])
    return used / CLOCK_TICKS


def one_row_request(model: str, input_name: str = "x", width: int = 16) -> kserve.ModelInferRequest:
    """A one-row FP32 request (`input_name`, shape [1, width]) such as the synthetic models take, past the
    result cache (`cache=false`): the burst repeats it, and a cached answer would skip the path measured."""
    request = kserve.ModelInferRequest(model_name=model)
    request.inputs.add(name=input_name, datatype="FP32", shape=[1, width])
    request.raw_input_contents.append(np.ones((1, width), "<f4").tobytes())
    request.parameters["cache"].bool_param = False
    return request


@dataclass(frozen=True)
class RouterSpeed:
    """What a closed-loop burst measured: answers, the window, and the router's CPU over it."""

    answered: int
    """OK answers within the measured window."""
    failed: int
    """Other outcomes within it (a calibration with many is suspect: `measure_router` refuses it)."""
    wall_s: float
    """The measured window (after the warm-up)."""
    router_cpu_s: float
    """CPU the router process used in the window; the whole process when the router runs in-process
    (then it includes the generator)."""
    rps: float
    """Requests answered per second in the slowest part of the window (`measure_router`'s `parts`): what
    rates are derived from. The CPU this path gets varies while other work shares the machine, and a test
    runs through its lean moments too."""

    @property
    def mean_rps(self) -> float:
        """Requests answered per second over the whole window."""
        return self.answered / self.wall_s

    @property
    def router_cpu_ms(self) -> float:
        """Router CPU milliseconds per answered request."""
        return 1000 * self.router_cpu_s / max(1, self.answered)

    def describe(self) -> str:
        """One line for a test's or benchmark's output."""
        return (
            f"router path flat out: {self.rps:.0f} req/s in its slowest part ({self.mean_rps:.0f} req/s, "
            f"{self.answered} in {self.wall_s:.1f} s), router CPU {self.router_cpu_ms:.2f} ms/request"
        )


class _Burst:
    """Closed-loop callers that count outcomes only while the measured window is open."""

    def __init__(
        self,
        stubs: list[kserve_grpc.GRPCInferenceServiceAsyncStub],
        request: kserve.ModelInferRequest,
        metadata: Metadata,
    ) -> None:
        self._stubs, self._request, self._metadata = stubs, request, metadata
        self.counting = False
        self.answered = self.failed = 0

    async def caller(self, index: int, until: float) -> None:
        stub = self._stubs[index % len(self._stubs)]
        while time.monotonic() < until:
            try:
                await stub.ModelInfer(self._request, timeout=10, metadata=self._metadata)
                ok = True
            except grpc.aio.AioRpcError:
                ok = False
            if self.counting:
                self.answered += ok
                self.failed += not ok


async def measure_router(
    target: str,
    request: kserve.ModelInferRequest,
    *,
    router_pid: int,
    metadata: Metadata = (),
    concurrency: int = 32,
    warmup_s: float = 0.5,
    duration_s: float = 2.0,
    parts: int = 4,
) -> RouterSpeed:
    """Run the closed loop against `target` (see the module docstring), counting answers in `parts` equal
    parts of `duration_s`; `router_pid` is the router's process (this one's for an in-process router)."""
    channels = [grpc.aio.insecure_channel(target) for _ in range(2)]
    try:
        burst = _Burst([kserve_grpc.GRPCInferenceServiceStub(c) for c in channels], request, metadata)
        until = time.monotonic() + warmup_s + duration_s
        callers = asyncio.gather(*(burst.caller(i, until) for i in range(concurrency)))
        await asyncio.sleep(warmup_s)
        burst.counting, started, cpu_before = True, time.monotonic(), process_cpu_s(router_pid)
        rates = []
        for _ in range(parts):
            opened, answered = time.monotonic(), burst.answered
            await asyncio.sleep(duration_s / parts)
            rates.append((burst.answered - answered) / (time.monotonic() - opened))
        burst.counting, wall_s = False, time.monotonic() - started
        cpu_s = process_cpu_s(router_pid) - cpu_before
        await callers
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    speed = RouterSpeed(burst.answered, burst.failed, wall_s, cpu_s, min(rates))
    if speed.rps <= 0 or speed.failed > 0.01 * (speed.answered + speed.failed):
        raise RuntimeError(f"calibration burst mostly failed: {speed}")
    return speed


def scale_for(wanted_rps: float, measured_rps: float, headroom: float) -> float:
    """How much slower (>= 1) a test must run so that `wanted_rps` becomes at most `headroom` of what its
    router path was measured to serve flat out: its rates divided by it, its simulated device times and
    deadlines multiplied by it, the regime unchanged but for the time scale."""
    if not 0 < headroom <= 1 or measured_rps <= 0 or not math.isfinite(measured_rps):
        raise ValueError(f"headroom {headroom} and measured rate {measured_rps} must be positive")
    return max(1.0, wanted_rps / (headroom * measured_rps))
