"""`sluice sim`: the discrete-event simulator of the router's policies (docs/batching.md).

Three modes on one scenario: a plain run (the scenario's policy, overridable by flags), `--compare` (each
variant at the scenario's load) and `--sweep` (each variant over a range of loads, with `--plot` drawing
goodput, p99 and shed share against offered load). Exit codes follow the other subcommands: 0 the runs
completed, 1 bad arguments or scenario (or `--plot` without matplotlib). The simulator is imported only
when the command runs, so `sluice --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sluice_inference.cli.parsing import add_command

EXIT_OK, EXIT_BAD_ARGS = 0, 1


def _loads(text: str) -> list[float]:
    try:
        loads = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of loads: {text!r}") from None
    if not loads or any(v <= 0 for v in loads):
        raise argparse.ArgumentTypeError("loads must be positive")
    return loads


def add_sim_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """Register `sluice sim` on the top-level subparsers."""
    sim = add_command(
        sub,
        "sim",
        "Simulate the router's policies in virtual time on a scenario.",
        "Settings: the scenario YAML (bench/scenarios/sim_*.yaml); flags override it; --config is not read.",
        "Drives the router's own admission, lanes, batcher, scheduler and estimators with simulated "
        "workers, and reports throughput, goodput, SLO attainment, shed rate and latency percentiles.",
    )
    sim.add_argument("scenario", type=Path, help="simulator scenario YAML (bench/scenarios/sim_*.yaml)")
    sim.add_argument("--rate", type=float, help="arrivals per second (overrides the scenario's rate/load)")
    sim.add_argument("--load", type=float, help="offered load as a multiple of the fleet's capacity")
    sim.add_argument("--duration", type=float, help="seconds of arrivals (overrides duration_s)")
    sim.add_argument("--seed", type=int, help="random seed (overrides the scenario)")
    sim.add_argument("--batcher", choices=["adaptive", "timer"], help="batching policy")
    sim.add_argument(
        "--scheduler", choices=["expected_completion", "least_loaded", "round_robin"], help="worker choice"
    )
    sim.add_argument("--no-admission", action="store_true", help="turn admission off (unbounded FIFO)")
    mode = sim.add_mutually_exclusive_group()
    mode.add_argument("--compare", action="store_true", help="run every variant at the scenario's load")
    mode.add_argument(
        "--sweep",
        nargs="?",
        const=[],
        type=_loads,
        metavar="LOADS",
        help="run every variant at each load (comma-separated multiples of capacity; default: the scenario)",
    )
    sim.add_argument("--class", dest="cls", metavar="NAME", help="report this class instead of the totals")
    sim.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    sim.add_argument("--json", type=Path, metavar="PATH", help="also write every run's full report")
    sim.add_argument("--plot", type=Path, metavar="PNG", help="--sweep: goodput, p99, shed vs offered load")
    sim.add_argument("--workers-plot", type=Path, metavar="PNG", help="rows per worker of each run")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    policy: dict[str, Any] = {}
    if args.batcher:
        policy["batcher"] = args.batcher
    if args.scheduler:
        policy["scheduler"] = args.scheduler
    if args.no_admission:
        policy["admission"] = False
    return {"rate": args.rate, "load": args.load, "duration_s": args.duration, "seed": args.seed,
            "policy": policy}  # fmt: skip


def _print_run(summary: dict[str, Any], markdown: bool) -> None:
    from sluice_inference.bench.sim.experiments import class_table, results_table
    from sluice_inference.bench.sim.results import worker_table

    print(results_table([summary], markdown=markdown))
    print()
    print(class_table(summary, markdown=markdown))
    if summary["workers"]["detail"]:
        print()
        print(worker_table(summary, markdown=markdown))
    cuts = ", ".join(f"{k}={v}" for k, v in summary["batches"]["cut_reasons"].items())
    workers = summary["workers"]
    print(
        f"\nbatches cut by: {cuts}; workers: {workers['count']}, mean busy {100 * workers['busy_mean']:.0f} %"
    )


def _validate_args(args: argparse.Namespace) -> str | None:
    if args.rate is not None and args.load is not None:
        return "give --rate or --load, not both"
    if args.plot is not None and args.sweep is None:
        return "--plot draws a sweep: add --sweep"
    return None


def run_sim(args: argparse.Namespace) -> int:
    """Run `sluice sim` with parsed arguments; returns the exit code."""
    from sluice_inference.bench.loadgen_scenario import ScenarioError
    from sluice_inference.bench.sim.experiments import compare, results_table, run_plain, speed_line, sweep
    from sluice_inference.bench.sim.plots import PlotUnavailable, plot_sweep, plot_worker_share
    from sluice_inference.bench.sim.scenario import load_sim_scenario

    problem = _validate_args(args)
    if problem:
        print(f"sluice sim: error: {problem}", file=sys.stderr)
        return EXIT_BAD_ARGS
    try:
        scenario = load_sim_scenario(args.scenario, _overrides(args))
        if args.cls is not None and args.cls not in {c.name for c in scenario.classes}:
            raise ScenarioError(f"--class: no class named {args.cls!r}")
    except ScenarioError as exc:
        print(f"sluice sim: scenario error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    print(f"sluice sim: {args.scenario.name}: capacity {scenario.capacity_rps:,.0f} req/s at full batches, "
          f"{sum(g.count for g in scenario.workers)} workers", flush=True)  # fmt: skip
    if args.compare:
        summaries = compare(scenario)
    elif args.sweep is not None:
        summaries = sweep(scenario, args.sweep or None)
    else:
        summaries = [run_plain(scenario)]
    if len(summaries) == 1 and args.cls is None:
        _print_run(summaries[0], args.markdown)
    else:
        print(results_table(summaries, args.cls, markdown=args.markdown))
    print(speed_line(summaries), flush=True)
    try:
        if args.plot is not None:
            title = f"{args.scenario.name}: {scenario.description}"
            print(f"wrote {plot_sweep(summaries, args.plot, title=title, cls=args.cls)}")
        if args.workers_plot is not None:
            print(f"wrote {plot_worker_share(summaries, args.workers_plot, title=args.scenario.name)}")
    except PlotUnavailable as exc:
        print(f"sluice sim: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    if args.json is not None:
        args.json.write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"wrote {args.json}")
    return EXIT_OK
