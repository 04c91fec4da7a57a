"""Several routers sharing workers, in the simulator: what each router's view of the others buys.

Runs `bench/scenarios/sim_multi_router.yaml` (2 workers, each holding at most 4 batches from all routers,
open-loop load at 0.8 x capacity) three ways at the same total load — one router; three routers that see
each other's batches on the workers (load reports every 250 ms and the queue length on every answer);
three routers blind to each other (as before 2026-11-30) — and prints p99, answers that came too late,
the mean batch a router sent, the mean forward a worker ran (batches of one lane waiting from several
routers merge) and the deepest queue a worker held.

    python -m sluice_inference.bench.multi_router [--duration 20] [--load 0.8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from sluice_inference.bench.sim.engine import simulate
from sluice_inference.bench.sim.plan import plan_run
from sluice_inference.bench.sim.results import format_table
from sluice_inference.bench.sim.scenario import parse_sim_scenario

SCENARIO = Path(__file__).parent / "scenarios" / "sim_multi_router.yaml"
VARIANTS = {
    "1 router": {"routers": 1},
    "3 routers, aware": {"routers": 3},
    "3 routers, blind": {"routers": 3, "workers_report_load": False},
}


def run(variant: dict[str, Any], duration_s: float, load: float) -> dict[str, Any]:
    """One variant's summary."""
    data = yaml.safe_load(SCENARIO.read_text())
    scenario = parse_sim_scenario({**data, **variant, "duration_s": duration_s, "load": load})
    return simulate(plan_run(scenario)).summary()


def row(name: str, summary: dict[str, Any]) -> list[str]:
    """One table row."""
    total = summary["total"]
    late = total["rejected_by_status"]
    expired = sum(count for status, count in late.items() if status.startswith("DEADLINE_EXCEEDED"))
    batches = summary["batches"]
    return [
        name, f"{total['offered_rps']:.0f}", f"{total['slo_pct']:.2f}", f"{total['latency_ms']['p99']:.1f}",
        f"{100 * expired / max(1, total['offered']):.2f}", f"{batches['mean_rows']:.1f}",
        f"{batches['mean_forward_rows']:.1f}", str(summary["workers"]["max_held"]),
    ]  # fmt: skip


COLUMNS = ["routers", "offered/s", "SLO %", "p99 ms", "late %", "router batch", "forward batch", "max held"]


def main(argv: list[str] | None = None) -> int:
    """Run the three variants and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals (default 20)")
    parser.add_argument("--load", type=float, default=0.8, help="x the workers' capacity (default 0.8)")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    args = parser.parse_args(argv)
    summaries = {name: run(variant, args.duration, args.load) for name, variant in VARIANTS.items()}
    print(format_table([row(name, s) for name, s in summaries.items()], markdown=True, columns=COLUMNS))
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
