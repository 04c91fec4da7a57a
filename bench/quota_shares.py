"""Quota shares across many routers, in the simulator: what following demand buys over the equal split.

Runs `bench/scenarios/sim_quota_shares.yaml` (20 routers; tenants with quotas placed on one router, on a
few, on all, or under their limit) twice on the same arrivals — shares following demand
(`admission.quota_shares: demand`) and the equal split 1/N — and prints, per tenant, its limit, the rate
it offered and the rate admitted (not refused by a quota), over the whole run, cold start included.

    python -m sluice_inference.bench.quota_shares [--duration 20] [--routers 20] [--json out.json]
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

SCENARIO = Path(__file__).parent / "scenarios" / "sim_quota_shares.yaml"
MODES = ("demand", "equal")
COLUMNS = ["tenant", "placement", "limit/s", "offered/s", "admitted/s demand", "% of limit",
           "admitted/s equal", "% of limit"]  # fmt: skip


def run(mode: str, duration_s: float, routers: int) -> dict[str, Any]:
    """One run's summary with quota shares in `mode`."""
    data = yaml.safe_load(SCENARIO.read_text())
    fields = {"duration_s": duration_s, "routers": routers, "policy": {"quota_shares": mode}}
    return simulate(plan_run(parse_sim_scenario({**data, **fields}))).summary()


def placements(routers: int) -> dict[str, str]:
    """Where each tenant's classes land, in words."""
    scenario = parse_sim_scenario({**yaml.safe_load(SCENARIO.read_text()), "routers": routers})
    where: dict[str, list[str]] = {}
    for c in scenario.classes:
        share = f"{c.weight / sum(k.weight for k in scenario.classes if k.tenant == c.tenant):.0%}"
        routers_of = "all" if c.placement is None else ",".join(str(r) for r in c.placement)
        where.setdefault(c.tenant, []).append(f"{share} on {routers_of}")
    return {tenant: "; ".join(parts) for tenant, parts in where.items()}


def rows(summaries: dict[str, dict[str, Any]], routers: int) -> list[list[str]]:
    """One row per tenant with a quota."""
    demand, equal = summaries["demand"]["tenants"], summaries["equal"]["tenants"]
    where = placements(routers)
    return [
        [name, where[name], f"{t['limit_rps']:g}", f"{t['offered_rps']:.0f}",
         f"{t['admitted_rps']:.1f}", f"{t['admitted_of_limit_pct']:.1f}",
         f"{equal[name]['admitted_rps']:.1f}", f"{equal[name]['admitted_of_limit_pct']:.1f}"]
        for name, t in demand.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run both modes and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals (default 20)")
    parser.add_argument("--routers", type=int, default=20, help="routers (default 20; the placements need 6)")
    parser.add_argument("--json", type=Path, help="write both summaries here")
    args = parser.parse_args(argv)
    summaries = {mode: run(mode, args.duration, args.routers) for mode in MODES}
    print(format_table(rows(summaries, args.routers), markdown=True, columns=COLUMNS))
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
