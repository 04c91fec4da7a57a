"""`sluice bench`: run an open-loop load scenario, or measure the generator's own ceiling (docs/loadgen.md).

Exit codes follow the other subcommands: 0 the run completed (whatever the server answered), 1 bad
arguments or scenario, 2 cannot connect, 3 an RPC needed to start (model metadata) failed. The load
generator is imported only when the command runs, so `sluice --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from sluice_inference.cli.parsing import add_command

EXIT_OK, EXIT_BAD_ARGS = 0, 1


def _steps(text: str) -> list[float]:
    try:
        steps = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of rates: {text!r}") from None
    if not steps or any(s <= 0 for s in steps):
        raise argparse.ArgumentTypeError("rates must be positive")
    return steps


def add_bench_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """Register `sluice bench` on the top-level subparsers."""
    bench = add_command(
        sub,
        "bench",
        "Send a scenario's open-loop load to a router and report per traffic class.",
        "Settings: the scenario YAML (bench/scenarios/); flags override its fields (--target, --rate, "
        "--duration, --seed, --channels); --config is not read.",
        "Reports offered rate, throughput, goodput, rejections by status and reason, latency percentiles "
        "and send lag; no retries. --ceiling measures the generator itself against a sink server.",
    )
    bench.add_argument("scenario", nargs="?", type=Path, help="scenario YAML (see bench/scenarios/)")
    bench.add_argument("--target", help="router HOST:PORT or gRPC URI (overrides the scenario's target)")
    bench.add_argument("--rate", type=float, help="total arrivals per second (overrides the scenario)")
    bench.add_argument("--duration", type=float, help="seconds of arrivals (overrides duration_s)")
    bench.add_argument("--seed", type=int, help="random seed (overrides the scenario)")
    bench.add_argument("--channels", type=int, help="gRPC connections to spread requests over")
    bench.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to wait for the target (default 10)"
    )
    bench.add_argument("--json", type=Path, metavar="PATH", help="also write the full report (with timeline)")
    bench.add_argument(
        "--ceiling", action="store_true", help="measure the generator's max send rate against a sink server"
    )
    bench.add_argument(
        "--steps", type=_steps, default=None, help="ceiling ramp, req/s (default 500,1000,2000,4000,8000)"
    )
    bench.add_argument("--step-s", type=float, default=3.0, help="seconds per ceiling step (default 3)")
    bench.add_argument(
        "--in-process-sink",
        action="store_true",
        help="ceiling: run the sink in this process (default: a subprocess)",
    )


def _write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")


def _ceiling(args: argparse.Namespace) -> int:
    from sluice_inference.bench.loadgen_ceiling import DEFAULT_STEPS, format_ceiling, measure_ceiling

    report = asyncio.run(
        measure_ceiling(
            args.steps or DEFAULT_STEPS, args.step_s, args.channels or 4, in_process=args.in_process_sink
        )
    )
    print(format_ceiling(report))
    _write_json(args.json, report)
    return EXIT_OK


def run_bench(args: argparse.Namespace) -> int:
    """Run `sluice bench` with parsed arguments; returns the exit code."""
    if args.ceiling:
        return _ceiling(args)
    from sluice_inference.bench.loadgen import LoadgenError, run_scenario
    from sluice_inference.bench.loadgen_scenario import ScenarioError, load_scenario
    from sluice_inference.bench.loadgen_stats import format_report

    if args.scenario is None:
        print("sluice bench: error: give a SCENARIO.yaml (or --ceiling)", file=sys.stderr)
        return EXIT_BAD_ARGS
    overrides = {"target": args.target, "rate": args.rate, "duration_s": args.duration, "seed": args.seed,
                 "channels": args.channels}  # fmt: skip
    try:
        scenario = load_scenario(args.scenario, overrides)
    except ScenarioError as exc:
        print(f"sluice bench: scenario error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    print(
        f"sluice bench: {scenario.scheduled} requests over {scenario.duration_s:g} s "
        f"({scenario.rate:g}/s, {scenario.arrivals.process}) to {scenario.target}",
        flush=True,
    )
    try:
        report = asyncio.run(run_scenario(scenario, connect_timeout_s=args.connect_timeout))
    except LoadgenError as exc:
        print(f"sluice bench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(format_report(report), flush=True)
    for warning in report["warnings"]:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    _write_json(args.json, report)
    return EXIT_OK
