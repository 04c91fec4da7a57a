"""Head-of-line protection end to end: long inputs (their own lane, 30x the per-row cost) arriving at one
per ten short ones leave the short requests' p99 within `TOLERANCE` of what it is without them.

The 20 % promise itself is asserted where it can be measured without noise, in the simulator
(tests/unit/bench/test_sim_policies.py; on this very setting, `sim_hol_seq.yaml`, it shows 1.09-1.18 with
the calibrated overheads, and one padded lane 1.6 times). Here, with a router, two workers and the load
generator on two shared cores, a p99 of ~15 ms carries several ms of scheduling noise (the same 4 ms
forward was seen to take up to 24 ms), so the end-to-end bound is 35 %.

What protects the short ones: long inputs get their own lane (bucket 256); a batch is capped by cost
(`max_batch_cost` 256 padded elements: one long row), so a long batch holds a worker for one row's time;
and the expected-completion scheduler sends short batches to the worker that is not busy with it.

The regime is worker-side: the tail compared is made by lanes, batches and worker choice, so the router
must keep headroom, or its own queueing makes the tail on both sides. The rate is derived at the start
from an in-process router driven flat out (tests/support/calibration.py): where the offered load is more
than `HEADROOM` of it, the test runs time-scaled by `scale_for` (rates divided; the model's times, the
deadlines and the runs' durations multiplied), the same comparison slower.

A run the machine disturbed says nothing about lanes: a stall of a few hundred ms makes the p99 of a 10 s run
(its 15th-worst answer) on either side, alone or mixed (16-63 ms alone on a quiet fresh machine, 79 ms in a
failed fresh-clone run). The load generator flags such runs itself: its send lag's p99 passes `LAG_WARNING_S`
when it could not keep its own schedule, and in probes here exactly the runs with disturbed tails had it at
5.7-9.3 ms, the others at 2.2-3.4 ms. Other work on the machine can disturb the router and the workers without
the generator noticing: a type check run beside the suite took one mixed run's p99 from ~17 to 39 ms with the
send lag at 3.2 ms, so a run also counts as disturbed when the rest of the machine took more than
`FOREIGN_MAX_CORES` in any 2 s of it (tests/support/foreign_cpu.py). The router itself runs in the test's
process, so a full collection of the session's heap would stall it too (once 368 ms inside a mixed run, with
both guards quiet): `make_router` freezes that heap while its routers run (tests/integration/conftest.py),
and the pauses seen here fell from 380 ms to under 3 ms. So pairs are run until `PAIRS` ran
undisturbed on both sides (at most `MAX_PAIRS`), and only such pairs are compared. When the machine leaves
fewer than that (a fresh-clone run beside other work had all five pairs at 6-23 ms, the p99s rising from 15 to
115 ms on both sides), the test is skipped and says so: those tails measure the machine, and asserting on them
failed a change that touched neither lanes nor workers. A router that hogged the CPU would disturb the
generator too, but that is the throughput and idle tests' to catch; lanes, cost caps and worker choice do not
move the generator's schedule. It fails where protection is gone: with one lane per model and no cost cap
(short rows padded to a long one's bucket), undisturbed pairs came out at 1.30 and 1.65 times, 1.47 together.
With only one of the two broken, or round-robin worker choice and no cap, it passed here: the finer promise is
the simulator's."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice_inference.bench.calibration import scale_for
from sluice_inference.bench.loadgen import LAG_WARNING_S
from sluice_inference.router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.calibration import router_path_speed
from tests.support.foreign_cpu import ForeignCpu
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

SHORT, LONG = 8, 256
RATE_SHORT = 150.0
"""Short requests per second at scale 1; long ones add a tenth."""
DURATION_S = 10
BENCH_TIMEOUT_S = 60
TOLERANCE = 1.35
PAIRS, MAX_PAIRS = 2, 5
"""Pairs compared, and the most run to find that many the machine left undisturbed."""
FOREIGN_MAX_CORES = 0.2
"""The most CPU the rest of the machine may take in any `FOREIGN_WINDOW_S` of a run compared (this test's
own processes and a hypervisor's steal aside): a quiet machine's background is a few hundredths of a core.
Judged over the whole run, a burst of a quarter of a core passed (the average stayed under the bound) and
made the side it fell on fail the comparison."""
FOREIGN_WINDOW_S = 2.0
"""The windows other work is judged in: a few of the short class's p99 answers' worth of a 15 s run."""
HEADROOM = 0.2
"""The offered load is at most this share of what the calibration's router served flat out: half what the
throughput tests allow, because the tail compared is a few milliseconds of the workers' time, and a CPU
busier than this adds its own queueing of that order (with a busy loop on one core, at 0.36 of it, the
short p99 went from 20 ms alone to 30-37 ms mixed)."""


def repository(root: Path, scale: float) -> Path:
    """`seq`: a simulated sequence model, t = 3 ms + 0.1 ms/row + 0.02 ms/row/token at scale 1, buckets 16
    and 256."""
    folder = root / "seq"
    (folder / "1").mkdir(parents=True)
    config = {
        "name": "seq",
        "backend": "synthetic",
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}],
        "max_batch_size": 16,
        "batching": {"max_wait_ms": 2.0, "buckets": {"x": [16, 256]}, "max_batch_cost": 256},
        "synthetic": {"base_ms": 3.0 * scale, "per_item_ms": 0.1 * scale, "per_token_ms": 0.02 * scale},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return root


@dataclass(frozen=True)
class Run:
    """One run's short-class p99 and how far the generator fell behind its schedule (both ms), and the
    cores the rest of the machine took in the busiest window of it."""

    p99_ms: float
    lag_p99_ms: float
    foreign_cores: float

    @property
    def undisturbed(self) -> bool:
        """The generator kept its schedule, as `sluice bench` judges it (it warns past this), and nothing
        else on the machine competed with the router and the workers for the cores."""
        return self.lag_p99_ms <= LAG_WARNING_S * 1000 and self.foreign_cores <= FOREIGN_MAX_CORES


async def short_run(router: RouterServer, folder: Path, scale: float, *, with_long: bool) -> Run:
    """The short class's p99 and the send lag under `DURATION_S` x `scale` of open-loop load from `sluice
    bench` in its own process: a generator in the test's event loop would share the router's loop and add
    its own scheduling delays to the very tail being compared."""
    deadline_ms = 2000 * scale
    classes: list[dict[str, Any]] = [
        {"name": "short", "weight": 10, "model": "seq", "deadline_ms": deadline_ms, "length": SHORT}
    ]
    if with_long:
        classes.append(
            {"name": "long", "weight": 1, "model": "seq", "deadline_ms": deadline_ms, "length": LONG}
        )
    load = {
        "target": f"127.0.0.1:{router.port}",
        "duration_s": DURATION_S * scale,
        "rate": RATE_SHORT / scale * (1.1 if with_long else 1.0),
        "seed": 9,
        "classes": classes,
    }
    scenario, report_path = folder / "load.yaml", folder / "report.json"
    scenario.write_text(yaml.safe_dump(load))
    foreign = ForeignCpu()
    bench = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sluice_inference.cli", "bench", str(scenario), "--json", str(report_path),
        stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert await asyncio.wait_for(_sampling(bench, foreign), BENCH_TIMEOUT_S * scale) == 0
    report = json.loads(report_path.read_text())
    short = next(c for c in report["classes"] if c["name"] == "short")
    assert short["ok"] == short["offered"]
    return Run(float(short["latency_ms"]["p99"]), float(report["send_lag_ms"]["p99"]), foreign.peak_cores)


async def _sampling(bench: asyncio.subprocess.Process, foreign: ForeignCpu) -> int:
    """The load generator's exit code, the other work on the machine judged every `FOREIGN_WINDOW_S`
    meanwhile (its busiest window is what can make a tail)."""
    exited = asyncio.ensure_future(bench.wait())
    try:
        while not exited.done():
            await asyncio.wait({exited}, timeout=FOREIGN_WINDOW_S)
            foreign.mark()
    finally:
        exited.cancel()
    return exited.result()


async def test_long_inputs_do_not_hold_short_ones_hostage(
    make_router: MakeRouter, spawn: Spawn, tmp_path: Path
) -> None:
    speed = await router_path_speed(make_router, spawn)
    scale = scale_for(RATE_SHORT * 1.1, speed.rps, HEADROOM)
    print(f"calibration: {speed.describe()}; scale {scale:.2f}: {RATE_SHORT / scale:.0f} short req/s")
    repo = repository(tmp_path / "models", scale)
    router = await make_router()
    spawn("w-1", models="seq", repository=repo)
    spawn("w-2", models="seq", repository=repo)
    await eventually(lambda: len(accepting_workers(router)) == 2, 60, "workers accepted")
    await short_run(router, tmp_path, scale, with_long=True)  # warm the estimates of both lanes
    pairs: list[tuple[Run, Run]] = []
    kept: list[tuple[Run, Run]] = []
    while len(pairs) < MAX_PAIRS and len(kept) < PAIRS:
        # Interleaved, so drift in the machine's load hits both sides alike.
        alone = await short_run(router, tmp_path, scale, with_long=False)
        pairs.append((alone, await short_run(router, tmp_path, scale, with_long=True)))
        if all(run.undisturbed for run in pairs[-1]):
            kept.append(pairs[-1])
    if len(kept) < PAIRS:
        lags = [round(max(run.lag_p99_ms for run in pair), 1) for pair in pairs]
        foreign = [round(max(run.foreign_cores for run in pair), 2) for pair in pairs]
        pytest.skip(
            f"the machine disturbed {len(pairs) - len(kept)} of {len(pairs)} pairs (send lag p99 {lags} ms, "
            f"bound {LAG_WARNING_S * 1000:g}; other work {foreign} cores, bound {FOREIGN_MAX_CORES}): "
            "it made their tails"
        )
    alone_ms, mixed_ms = sum(a.p99_ms for a, _ in kept), sum(m.p99_ms for _, m in kept)
    assert mixed_ms <= TOLERANCE * alone_ms, (scale, pairs)
