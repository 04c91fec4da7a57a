"""`sluice bench --ceiling`: how fast this generator can send, measured against a sink that answers at once.

A sink server (`sluice_inference.bench.loadgen_sink`, in a subprocess by default so it does not share the
generator's interpreter and core) answers every ModelInfer with a canned response. The generator runs one
Poisson step per rate (default 500, 1000, 2000, 4000, 8000 req/s, 3 s each) and records the rate it actually
sent at and its p99 send lag. A step passes when it sent within 5% of the asked rate with p99 lag under 5 ms;
the ceiling is the highest passing rate. The ramp stops at the first failing step (higher rates fail too).
Below the ceiling, a scenario's figures describe the server; above it, the generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import Scenario, TrafficClass
from sluice_inference.bench.loadgen_sink import SinkServer

DEFAULT_STEPS = (500, 1000, 2000, 4000, 8000)
RATE_TOLERANCE = 0.05
MAX_P99_LAG_MS = 5.0


@contextlib.asynccontextmanager
async def sink(in_process: bool) -> AsyncIterator[str]:
    """A running sink; yields its address."""
    if in_process:
        server = SinkServer()
        try:
            yield await server.start()
        finally:
            await server.stop(0)
        return
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sluice_inference.bench.loadgen_sink",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line.startswith("listening on "):
            raise RuntimeError(f"sink did not start (said {line!r})")
        yield line.removeprefix("listening on ").strip()
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


def step_scenario(target: str, rate: float, step_s: float, channels: int, seed: int) -> Scenario:
    """One ramp step: a single class of 1-row requests to the sink, with a generous deadline."""
    sink_class = TrafficClass(name="sink", model="sink", deadline_ms=1000, payloads=1)
    return Scenario(
        target=target, duration_s=step_s, rate=rate, seed=seed, channels=channels, classes=[sink_class]
    )


def step_result(rate: float, report: dict[str, Any]) -> dict[str, Any]:
    """The figures of one step and whether it passed."""
    sent = report["achieved_send_rps"]
    lag = report["send_lag_ms"]
    passed = sent >= (1 - RATE_TOLERANCE) * rate and (lag["p99"] or 0.0) < MAX_P99_LAG_MS
    return {
        "rate": rate,
        "sent_rps": sent,
        "send_lag_p50_ms": lag["p50"],
        "send_lag_p99_ms": lag["p99"],
        "ok": report["total"]["ok"],
        "not_ok": report["total"]["rejected"],
        "not_ok_by_status": report["total"]["rejected_by_status"],
        "not_ok_examples": report["total"]["rejection_examples"],
        "latency_p99_ms": report["total"]["latency_ms"]["p99"],
        "passed": passed,
    }


async def measure_ceiling(
    steps: Sequence[float] = DEFAULT_STEPS, step_s: float = 3.0, channels: int = 4, in_process: bool = False
) -> dict[str, Any]:
    """Ramp through `steps`; the report lists each step and the ceiling (0 if even the first failed)."""
    results = []
    async with sink(in_process) as target:
        for index, rate in enumerate(steps):
            report = await run_scenario(step_scenario(target, rate, step_s, channels, seed=index))
            results.append(step_result(rate, report))
            if not results[-1]["passed"]:
                break
    ceiling = max((r["rate"] for r in results if r["passed"]), default=0)
    return {
        "ceiling_rps": ceiling,
        "steps": results,
        "step_s": step_s,
        "channels": channels,
        "sink": "in-process" if in_process else "subprocess",
        "criteria": f"sent >= {1 - RATE_TOLERANCE:.0%} of the rate and p99 send lag < {MAX_P99_LAG_MS:g} ms",
    }


def format_ceiling(report: dict[str, Any]) -> str:
    """The ramp as a table, then the ceiling."""
    lines = [f"{'rate':>8}  {'sent/s':>8}  {'lag p50 ms':>10}  {'lag p99 ms':>10}  {'not ok':>6}  result"]
    for s in report["steps"]:
        lines.append(
            f"{s['rate']:>8g}  {s['sent_rps']:>8.1f}  {s['send_lag_p50_ms']:>10.2f}  "
            f"{s['send_lag_p99_ms']:>10.2f}  {s['not_ok']:>6}  {'pass' if s['passed'] else 'FAIL'}"
        )
    lines.append(f"ceiling: {report['ceiling_rps']:g} req/s ({report['criteria']}; {report['sink']} sink)")
    return "\n".join(lines)
