"""Two tenants at 2x router-bound overload: does the front door keep gold's share and refuse bronze?

A local cluster (`sluice up`, one worker) serves a `synthetic` model that answers at once, so the router's
own CPU is the limit, not the worker (the regime the front door exists for, router/policy/door.py). First
the router path is measured flat out on a cluster with the door off (bench/calibration.py): R req/s. Then,
on a cluster whose door bound is `--door-ms`:

1. *served*: `--half` x R offered (gold and bronze alike), below saturation: router CPU per served request;
2. *overload*: `--factor` x R offered (default 2; several factors give one run each, and with `--plot`
   the overload curves of both tenants), gold `--gold-share` of it (0.25: at 2 x R gold alone is half of
   R) and bronze the rest.

For each run it prints, per tenant, offered / within the SLO (OK within the deadline every request sends)
/ refused by the door (UNAVAILABLE `router_overloaded`, each with its retry hint) / other outcomes (late
or failed), and the router's CPU per served and per refused request. The refusal cost is what the
overload run's router CPU leaves once its OK answers are charged at the served run's cost per request,
divided by the refusals (an estimate: at overload batches are larger, so a served request is cheaper and
the refusal estimate errs high; it is given only where it means something, `refusal_ms`). Issue 17's
goals: gold keeps >= 95 % of its offered load within the SLO; refusing costs <= 1/3 of serving.

    python -m sluice_inference.bench.two_tenant_overload [--duration 10] [--door-ms 20] [--slo-ms 100]
        [--factor 1 1.5 2 3 4 --plot docs/figures/two_tenants.png] [--no-pin]

By default (with two cores or more to run on) the router and worker run on one core and this load
generator on another, as the shared peer harness pins them: unpinned, at 2 x R on a fast machine the
generator and the router share both cores and the run measures no goal. Each run also says how much of
a core the generator itself used; above `GENERATOR_SHORT` of one it was short of CPU, and the run says
that it measures no goal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice_inference.bench.calibration import process_cpu_s
from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.bench.overload import (
    BRONZE_KEY,
    GOLD_KEY,
    Cluster,
    gold_and_bronze,
    gold_flat_out,
    running_cluster,
    write_repository,
    write_yaml,
)
from sluice_inference.bench.scratch import scratch_folder

REFUSED_MIN = 0.1
"""The share of an overload run's calls that must be door refusals for their cost to be estimated."""
UNPLACED_MAX = 0.1
"""The share of an overload run's calls that may end neither OK nor refused for its refusal cost to be
estimated (their CPU is charged to the refusals: the estimate errs high by up to about that share)."""
GENERATOR_SHORT = 0.9
"""The load generator's share of a core above which it could not offer the load on time."""
DOOR_REFUSAL = "UNAVAILABLE/router_overloaded"
"""How the load report names a front-door refusal."""


def write_config(path: Path, *, door_ms: float) -> Path:
    """sluice.yaml: gold (priority 1) and bronze (priority 3), quotas far above the load, the door's bound."""
    return write_yaml(
        path,
        {
            "router": {"door_max_delay_ms": door_ms, "door_sustain_s": 0.5},
            "tenants": gold_and_bronze({"rate": 1_000_000, "burst": 100_000, "max_inflight": 1_000_000}),
        },
    )


def scenario(target: str, rate: float, gold_share: float, duration_s: float, slo_ms: float) -> dict[str, Any]:
    """Poisson arrivals at `rate`, `gold_share` of them gold's."""
    common = {"model": "synthetic", "deadline_ms": slo_ms, "rows": 1, "cache": False}
    return {
        "target": target,
        "duration_s": duration_s,
        "rate": rate,
        "arrivals": {"process": "poisson"},
        "seed": 17,
        "channels": 4,
        "classes": [
            {"name": "gold", "weight": gold_share, "tenant_key": GOLD_KEY, "tenant": "gold", **common},
            {
                "name": "bronze",
                "weight": 1 - gold_share,
                "tenant_key": BRONZE_KEY,
                "tenant": "bronze",
                **common,
            },
        ],
    }


@dataclass(frozen=True)
class Run:
    """One load run: the generator's report and the router's CPU seconds over it."""

    label: str
    report: dict[str, Any]
    router_cpu_s: float
    generator_cores: float
    """This process's CPU over the run per second of it: the load generator's share of a core."""

    def tenant(self, name: str) -> dict[str, Any]:
        """The report's figures for one tenant."""
        return next(c for c in self.report["classes"] if c["name"] == name)

    @property
    def ok(self) -> int:
        """OK answers, both tenants."""
        return int(self.report["total"]["ok"])

    @property
    def offered(self) -> int:
        """Calls offered, both tenants."""
        return int(self.report["total"]["offered"])

    @property
    def refused(self) -> int:
        """Front-door refusals, both tenants."""
        return int(self.report["total"]["rejected_by_status"].get(DOOR_REFUSAL, 0))


def pin(cluster: Cluster | None, core: int) -> None:
    """Every thread of the cluster's processes (None: this process) onto one core, as the shared peer
    harness pins a server and its load generator to cores of their own. Threads started later inherit it."""
    children = () if cluster is None else (cluster.router, cluster.worker, cluster.etcd)
    pids = [c.process.pid for c in children] or [os.getpid()]
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(task), {core})


def run_load(target: str, router_pid: int, label: str, load: dict[str, Any]) -> Run:
    """Offer `load` and read the router's CPU, and this load generator's, over it."""
    before, own_before, started = process_cpu_s(router_pid), process_cpu_s(os.getpid()), time.monotonic()
    report = asyncio.run(run_scenario(parse_scenario(load)))
    own = (process_cpu_s(os.getpid()) - own_before) / max(1e-9, time.monotonic() - started)
    return Run(label, report, process_cpu_s(router_pid) - before, own)


TABLE_HEAD = (
    "| run | tenant | offered req/s | within SLO req/s | within SLO % | door refusals % | with hint % "
    "| other outcomes | p99 OK ms |\n|---|---|---|---|---|---|---|---|---|"
)
"""The per-tenant table's header (this bench's and bench/minimal_two_tenant.py's)."""


def tenant_row(label: str, figures: dict[str, Any]) -> str:
    """One run's figures for one tenant (a class of the load report): offered, within the SLO, refused at
    the door, the share of refusals with a retry hint, other outcomes (late OK answers and other failures)
    and the OK answers' p99."""
    offered = max(1, figures["offered"])
    refused = figures["rejected_by_status"].get(DOOR_REFUSAL, 0)
    p99 = figures["latency_ms"]["p99"]
    return (
        f"| {label} | {figures['name']} | {figures['offered_rps']:.0f} | {figures['goodput_rps']:.0f} | "
        f"{100 * figures['good'] / offered:.1f} | {100 * refused / offered:.1f} | "
        f"{100 * figures['rejected_with_hint'] / max(1, figures['rejected']):.0f} | "
        f"{figures['offered'] - figures['good'] - refused} | {'-' if p99 is None else f'{p99:.1f}'} |"
    )


def table(runs: list[Run]) -> str:
    """Markdown: per run and tenant, `tenant_row`."""
    rows = [tenant_row(run.label, run.tenant(name)) for run in runs for name in ("gold", "bronze")]
    return "\n".join([TABLE_HEAD, *rows])


def served_ms(served: Run) -> float:
    """Router CPU ms per served request, from the served run."""
    return 1000 * served.router_cpu_s / max(1, served.ok)


def refusal_ms(served: Run, overload: Run) -> float | None:
    """Router CPU ms per refusal in the overload run (see the module docstring). None when under
    `REFUSED_MIN` of its calls were refused (the few refusals then carry the served cost's noise: -27 ms a
    refusal at 1 x R), or when more than `UNPLACED_MAX` ended neither OK nor refused (failed at their
    deadline, most of them in gRPC's queue): their CPU is unknown, and charging it all to the refusals read
    1-2,000 ms a refusal at 2-4 x R); and when the served requests alone would take all of its CPU."""
    unplaced = overload.offered - overload.ok - overload.refused
    if overload.refused < REFUSED_MIN * overload.offered or unplaced > UNPLACED_MAX * overload.offered:
        return None
    refusing = 1000 * overload.router_cpu_s - served_ms(served) * overload.ok
    return refusing / overload.refused if refusing > 0 else None  # served cheaper than at half load


def plot(runs: list[Run], factors: list[float], path: Path) -> None:
    """The overload curves: per tenant, offered and within-SLO req/s, and the within-SLO share, against
    the load as a multiple of R."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rates, shares) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, colour in (("gold", "goldenrod"), ("bronze", "sienna")):
        figures = [run.tenant(name) for run in runs]
        rates.plot(
            factors, [f["offered_rps"] for f in figures], ls="--", color=colour, label=f"{name} offered"
        )
        rates.plot(
            factors, [f["goodput_rps"] for f in figures], marker="o", color=colour, label=f"{name} within SLO"
        )
        shares.plot(
            factors,
            [100 * f["good"] / max(1, f["offered"]) for f in figures],
            marker="o",
            color=colour,
            label=name,
        )
    rates.set_title("req/s per tenant")
    shares.set_title("within the SLO, % of the tenant's offered load")
    for axis in (rates, shares):
        axis.set_xlabel("offered load, x R (the router's flat-out rate)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def calibrate(workdir: Path, repository: Path, server_core: int | None) -> float:
    """R: the router's flat-out rate on a cluster with the door off (bench/calibration.py)."""
    config = write_config(workdir / "calibration" / "sluice.yaml", door_ms=0)
    with running_cluster(workdir / "calibration", repository, config) as cluster:
        if server_core is not None:
            pin(cluster, server_core)
        speed = gold_flat_out(cluster)
    print(f"calibration: {speed.describe()}", flush=True)
    return speed.rps


def report(args: argparse.Namespace, rate: float, served: Run, overloads: list[Run]) -> None:
    """The per-tenant table, each overload run's refusal cost, and the load generator's share of a core."""
    runs = [served, *overloads]
    print(
        f"\nR = {rate:.0f} req/s; door bound {args.door_ms:g} ms, SLO {args.slo_ms:g} ms, "
        f"{args.duration:g} s a run"
    )
    print(table(runs))
    print(f"\nrouter CPU: {served_ms(served):.3f} ms per served request ({served.label})")
    for run in overloads:
        refusal = refusal_ms(served, run)
        print(
            f"  {run.label}: "
            + ("per refusal not estimated" if refusal is None else f"{refusal:.3f} ms per refusal")
            + f"; {run.router_cpu_s / args.duration:.2f} of a core"
        )
    print(
        "load generator: "
        + ", ".join(f"{run.label} {run.generator_cores:.2f} of a core" for run in runs)
        + ("" if args.pin else "; not pinned: it shared the router's cores")
    )
    short = [run.label for run in runs if run.generator_cores > GENERATOR_SHORT]
    if short:
        print(f"the load generator was short of a core in {', '.join(short)}: that run measures no goal")


def main(argv: list[str] | None = None) -> int:
    """Calibrate, run below saturation and overloaded, print the per-tenant table and the costs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per run (default 10)")
    parser.add_argument("--door-ms", type=float, default=20.0, help="the door's delay bound (default 20)")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="every request's deadline (default 100)")
    parser.add_argument("--gold-share", type=float, default=0.25, help="gold's share of the overload")
    parser.add_argument(
        "--factor", type=float, nargs="+", default=[2.0], help="each overload run's load, x R (default 2)"
    )
    parser.add_argument("--half", type=float, default=0.5, help="the served run's load, x R (default 0.5)")
    parser.add_argument("--rate", type=float, help="R in req/s instead of calibrating it")
    parser.add_argument("--json", type=Path, help="write the load reports here")
    parser.add_argument("--plot", type=Path, help="draw the overload curves (one point per --factor) here")
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=len(os.sched_getaffinity(0)) >= 2,
        help="router and worker on one core, this load generator on another (default: with two or more)",
    )
    args = parser.parse_args(argv)
    server_core, generator_core = (sorted(os.sched_getaffinity(0)) * 2)[:2]
    if args.pin:
        pin(None, generator_core)  # the cluster's processes start here too, and move once started
    with scratch_folder("sluice-two-tenant-") as workdir:
        repository = write_repository(workdir / "models", base_ms=0.0, per_item_ms=0.0)
        rate = args.rate or calibrate(workdir, repository, server_core if args.pin else None)
        config = write_config(workdir / "run" / "sluice.yaml", door_ms=args.door_ms)
        with running_cluster(workdir / "run", repository, config) as cluster:
            if args.pin:
                pin(cluster, server_core)
            target, pid = f"127.0.0.1:{cluster.port}", cluster.router.process.pid

            def run_at(factor: float, gold_share: float) -> Run:
                load = scenario(target, factor * rate, gold_share, args.duration, args.slo_ms)
                return run_load(target, pid, f"{factor:g} x R", load)

            served = run_at(args.half, 0.5)
            overloads = [run_at(factor, args.gold_share) for factor in args.factor]
        report(args, rate, served, overloads)
        if args.plot:
            plot(overloads, args.factor, args.plot)
        if args.json:
            runs = [served, *overloads]
            args.json.write_text(json.dumps({"rate": rate, "runs": [r.report for r in runs]}))
        return 0


if __name__ == "__main__":
    sys.exit(main())
