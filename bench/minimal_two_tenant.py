"""Issue 17's two-tenant overload on the minimal path, behind an oracle door: the floor under any door.

Issue 17 asks that, with a gold and a bronze tenant at 2 x router-bound overload, gold keep >= 95 % of its
offered load within the SLO while bronze absorbs the refusals (bench/two_tenant_overload.py measures
Sluice at it). The project's rule: a goal may be declared out of reach only by measuring, in the same
sitting, the minimal path, a bare router and worker doing only the unavoidable work. This bench runs that
path at the goal's load, behind the cheapest door there can be.

The minimal path (bench/minimal_path.py): a grpc.aio router serving KServe v2 ModelInfer and a worker
process behind one grpc.aio bidi stream, one message per batch each way, batches cut as soon as the worker
is idle (up to 32 rows), the worker's forward a trivial numpy y = 2 x on FP32 [rows, 16] that answers at
once (the `synthetic` model with base_ms = per_item_ms = 0 of two_tenant_overload.py). No auth, quotas,
metrics, tracing, lanes or estimators.

The oracle door (the router's `--door`): before the body is parsed, the router reads the call's
`authorization` metadata and refuses every `Bearer bronze-key` call at once, UNAVAILABLE with a retry
pushback and the `sluice-reason` trailer Sluice's door sends (bench/grpc_floor.py's `aio-refuse`, the
~0.43 ms figure, sends the same two trailers). Gold is served. It is the floor of any door: a real one
must learn who is calling (hash a key, look up a tenant), decide from what it measures (queue delays,
rates) which share to refuse, and is sometimes wrong (it refuses gold, or lets bronze in and then serves
or drops it late). The oracle knows the answer in advance, spends nothing deciding it and is never wrong,
so what it cannot do at some load no door can do on this stack: the cost left is grpc.aio's own, per call,
to take a call in and refuse it, and the path's own to serve the calls let in. With the door off (the
calibration mode) every call is served.

The run (`main`): worker and router as child processes (with `--pin` both on core 0 and this load
generator on core 1, as two_tenant_overload.py pins); R = the minimal path's flat-out rate, measured with
gold calls and the door off (bench/calibration.py); then, with the door on, the project's load generator
offers, every request with an `--slo-ms` deadline:

1. *gold alone*: gold's share of the overload, `--factor` x `--gold-share` x R, by itself: what serving
   gold costs the router and worker (CPU per served call, cores);
2. *bronze alone*: bronze's share, by itself, every call refused at the door: what refusing bronze costs
   (CPU per bronze call, cores), measured directly rather than estimated from a mixed run;
3. *overload*: `--factor` x R, gold `--gold-share` of it (0.25: at 2 x R gold alone is half of R) and
   bronze the rest.

It prints, per run and tenant, offered / within the SLO / refused at the door / other outcomes / p99, and
the router + worker CPU per served call (run 1), per bronze call (run 2) and the cores each run used: when
runs 1 and 2 together need more than the one core the path has, no door can keep gold within its SLO at
that load, since the oracle's refusals are the cheapest there are.

    python -m sluice_inference.bench.minimal_two_tenant --pin [--duration 10] [--factor 2] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice_inference.bench.calibration import measure_router, one_row_request
from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.bench.minimal_path import (
    GOLD_AUTH,
    INPUT,
    MODEL,
    WIDTH,
    MinimalPath,
    running_minimal_path,
)
from sluice_inference.bench.scratch import scratch_folder
from sluice_inference.bench.two_tenant_overload import TABLE_HEAD, scenario, tenant_row


@dataclass(frozen=True)
class Measured:
    """One load run: the generator's report and the router's and the worker's CPU seconds over it."""

    label: str
    report: dict[str, Any]
    router_cpu_s: float
    worker_cpu_s: float

    @property
    def cpu_s(self) -> float:
        """Router and worker together."""
        return self.router_cpu_s + self.worker_cpu_s

    @property
    def ok(self) -> int:
        """OK answers, all tenants."""
        return int(self.report["total"]["ok"])


def measure(path: MinimalPath, label: str, load: dict[str, Any]) -> Measured:
    """Offer `load` through the project's load generator and read both processes' CPU over it."""
    router_before, worker_before = path.cpu_s()
    report = asyncio.run(run_scenario(parse_scenario(load)))
    router_after, worker_after = path.cpu_s()
    return Measured(label, report, router_after - router_before, worker_after - worker_before)


def table(runs: list[Measured]) -> str:
    """Markdown: per run and tenant, `tenant_row` (bench/two_tenant_overload.py)."""
    rows = [tenant_row(run.label, figures) for run in runs for figures in run.report["classes"]]
    return "\n".join([TABLE_HEAD, *rows])


def one_tenant(load: dict[str, Any], name: str) -> dict[str, Any]:
    """`load` reduced to one tenant's class at that tenant's share of its rate."""
    total = sum(c["weight"] for c in load["classes"])
    (only,) = [c for c in load["classes"] if c["name"] == name]
    return {**load, "rate": load["rate"] * only["weight"] / total, "classes": [only]}


def costs(gold: Measured, bronze: Measured, overload: Measured, duration_s: float) -> dict[str, float]:
    """Router + worker CPU ms per served call (gold alone) and per bronze call (bronze alone: each one
    refused at the door, or expired before it if the door could not keep up), and the cores each run used."""
    return {
        "ms_per_served": 1000 * gold.cpu_s / max(1, gold.ok),
        "router_ms_per_served": 1000 * gold.router_cpu_s / max(1, gold.ok),
        "ms_per_bronze_call": 1000 * bronze.cpu_s / max(1, bronze.report["total"]["offered"]),
        "cores_gold_alone": gold.cpu_s / duration_s,
        "cores_bronze_alone": bronze.cpu_s / duration_s,
        "cores_overload": overload.cpu_s / duration_s,
    }


def calibrate(core: int | None, log_dir: Path) -> float:
    """R: the minimal path flat out, gold calls only, the door off (bench/calibration.py)."""
    with running_minimal_path(door=False, core=core, log_dir=log_dir) as path:
        speed = asyncio.run(
            measure_router(
                path.target,
                one_row_request(MODEL, input_name=INPUT, width=WIDTH),
                router_pid=path.router.process.pid,
                metadata=(("authorization", GOLD_AUTH),),
            )
        )
    print(f"calibration: minimal {speed.describe()}", flush=True)
    return speed.rps


def report(args: argparse.Namespace, rate: float, runs: list[Measured], figures: dict[str, float]) -> None:
    """The table, the costs, the generator's warnings."""
    print(
        f"\nR = {rate:.0f} req/s (minimal path, door off); oracle door on; SLO {args.slo_ms:g} ms; "
        f"gold share {args.gold_share:g}; {args.duration:g} s a run"
    )
    print(table(runs))
    print(
        f"\nrouter + worker CPU: {figures['ms_per_served']:.3f} ms per served call (router alone "
        f"{figures['router_ms_per_served']:.3f}), {figures['ms_per_bronze_call']:.3f} ms per bronze call; "
        f"cores used: gold alone {figures['cores_gold_alone']:.2f}, bronze alone "
        f"{figures['cores_bronze_alone']:.2f}, {args.factor:g} x R {figures['cores_overload']:.2f}"
    )
    for run in runs:
        for warning in run.report["warnings"]:
            print(f"warning ({run.label}): {warning}")


def run_bench(args: argparse.Namespace) -> int:
    """Calibrate R (unless given), then gold alone, bronze alone and both behind the oracle door."""
    core = 0 if args.pin else None
    if args.pin:
        os.sched_setaffinity(0, {1})  # the children start here and move themselves to core 0
    with scratch_folder("sluice-minimal-two-tenant-") as workdir:
        rate = calibrate(core, workdir / "calibration") if args.rate is None else args.rate
        with running_minimal_path(door=True, core=core, log_dir=workdir / "run") as path:
            load = scenario(path.target, args.factor * rate, args.gold_share, args.duration, args.slo_ms)
            gold = measure(path, "gold alone", one_tenant(load, "gold"))
            bronze = measure(path, "bronze alone", one_tenant(load, "bronze"))
            overload = measure(path, f"{args.factor:g} x R", load)
        runs = [gold, bronze, overload]
        figures = costs(gold, bronze, overload, args.duration)
        report(args, rate, runs, figures)
        if args.json:
            reports = [{"label": r.label, "router_cpu_s": r.router_cpu_s, "worker_cpu_s": r.worker_cpu_s,
                        "report": r.report} for r in runs]  # fmt: skip
            args.json.write_text(json.dumps({"rate": rate, "runs": reports, **figures}))
        return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the options and run the bench."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per run (default 10)")
    parser.add_argument("--rate", type=float, help="R in req/s instead of calibrating it")
    parser.add_argument("--factor", type=float, default=2.0, help="the overload run's load, x R (default 2)")
    parser.add_argument("--gold-share", type=float, default=0.25, help="gold's share of it (default 0.25)")
    parser.add_argument("--slo-ms", type=float, default=50.0, help="every request's deadline (default 50)")
    parser.add_argument("--json", type=Path, help="write the figures and load reports here")
    parser.add_argument(
        "--pin", action="store_true", help="router and worker on core 0, this load generator on core 1"
    )
    args = parser.parse_args(argv)
    if not 0 < args.gold_share < 1 or args.factor <= 0:
        parser.error("--gold-share must be in (0, 1) and --factor positive")
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
