"""Runs built from a scenario: one plain run, a comparison of variants, a load sweep (pure, no I/O).

Every run of a comparison or sweep uses the scenario's seed, so two variants see the same arrivals (and a
variant that drops classes sees the others' arrivals unchanged): differences come from the policies.
A sweep scales the offered rate to `load x capacity_rps` of the *full* mix at each point, so curves of
variants that drop classes still line up on the same x.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sluice_inference.bench.sim.engine import simulate
from sluice_inference.bench.sim.plan import plan_run, variants_of
from sluice_inference.bench.sim.results import COLUMNS, format_table, table_row
from sluice_inference.bench.sim.scenario import SimScenario, Variant
from sluice_inference.common import compiled_core

Progress = Callable[[dict[str, Any]], None]


def _quiet(summary: dict[str, Any]) -> None:
    return None


def run_plain(scenario: SimScenario) -> dict[str, Any]:
    """The scenario as written (its own policy, no variant)."""
    return simulate(plan_run(scenario)).summary()


def compare(
    scenario: SimScenario, variants: Sequence[Variant] | None = None, progress: Progress = _quiet
) -> list[dict[str, Any]]:
    """Each variant at the scenario's rate."""
    summaries = []
    for variant in variants or variants_of(scenario):
        summary = simulate(plan_run(scenario, variant)).summary()
        progress(summary)
        summaries.append(summary)
    return summaries


def sweep(
    scenario: SimScenario,
    loads: Sequence[float] | None = None,
    variants: Sequence[Variant] | None = None,
    progress: Progress = _quiet,
) -> list[dict[str, Any]]:
    """Each variant at each load multiple of the full mix's capacity."""
    summaries = []
    capacity = scenario.capacity_rps
    for variant in variants or variants_of(scenario):
        for load in loads or scenario.sweep:
            summary = simulate(plan_run(scenario, variant, rate=load * capacity)).summary()
            progress(summary)
            summaries.append(summary)
    return summaries


def results_table(
    summaries: Sequence[dict[str, Any]], cls: str | None = None, *, markdown: bool = False
) -> str:
    """One row per run: totals, or the figures of class `cls`."""
    return format_table([table_row(s, cls) for s in summaries], markdown=markdown, columns=COLUMNS)


def class_table(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """One row per class of one run."""
    rows = []
    for name in summary["classes"]:
        row = table_row(summary, name)
        row[0] = name
        rows.append(row)
    return format_table(rows, markdown=markdown, columns=["class", *COLUMNS[1:]])


def speed_line(summaries: Sequence[dict[str, Any]]) -> str:
    """How fast the simulator went over these runs, start-up (building and registering the fleet)
    excluded: per wall-clock second, and per CPU-second of this process (a loaded machine lowers the
    first, not the second), and whether the policy core ran compiled (common/compiled_core.py)."""
    arrivals = sum(s["arrivals"] for s in summaries)
    wall = sum(s["sim"]["wall_s"] for s in summaries)
    cpu = sum(s["sim"]["cpu_s"] for s in summaries)
    events = sum(s["sim"]["events"] for s in summaries)
    return (
        f"simulated {arrivals:,} requests ({events:,} events) in {wall:.2f} s wall, start-up excluded: "
        f"{arrivals / max(wall, 1e-9):,.0f} requests per wall-clock second "
        f"({arrivals / max(cpu, 1e-9):,.0f} per CPU-second); policy core: {compiled_core.status()}"
    )
