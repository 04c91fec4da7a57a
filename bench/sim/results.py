"""What a run produced, and the figures built from it (pure).

Definitions (docs/batching.md repeats them), over the run's offered requests:
- good: OK within the client's deadline; **SLO attainment** = good / offered;
- **shed**: refused or dropped before running with a retryable status (UNAVAILABLE: queue full, deadline
  not meetable now or any more, evicted; RESOURCE_EXHAUSTED: quotas); `lost` (worker_lost) is counted apart;
- **expired**: DEADLINE_EXCEEDED (in the queue, skipped by the worker, or finished late);
- throughput and goodput are OK and good answers per second of the scenario's duration; latency
  percentiles are over OK answers, overhead included.
Per-request figures reuse the load generator's (`sluice_inference.bench.loadgen_stats.outcome_counts`), so a
simulated and a measured report mean the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from sluice_inference.bench.loadgen_stats import RequestRecord, outcome_counts
from sluice_inference.bench.sim.plan import RunPlan

WORKER_DETAIL_UP_TO: Final = 64
"""Reports list workers one by one up to this many; bigger fleets get a distribution."""
SHED_CODES: Final = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
QUOTA_REASONS: Final = ("tenant_rate", "tenant_inflight", "global_rate")
"""Refusals by a quota (the rest were admitted, whatever happened next)."""


@dataclass(frozen=True)
class WorkerStats:
    """What one simulated worker did."""

    worker_id: str
    speed: float
    batches: int
    """Forward passes it ran."""
    rows: int
    busy_s: float
    max_held: int
    """The most batches it held at once, from all routers."""


@dataclass
class SimResult:
    """The outcome of every arrival of one run, plus batch and worker counters."""

    plan: RunPlan
    records: list[RequestRecord]
    workers: list[WorkerStats]
    batch_rows: list[int]
    """Rows of each batch a router sent."""
    forward_rows: list[int]
    """Rows of each forward a worker ran (batches from several routers merge into one)."""
    cut_reasons: dict[str, int]
    late_rows: int
    """Rows executed for requests that then finished after their deadline: device time wasted."""
    redispatched: int
    """Dispatches of requests queued once more after their worker was lost (they end once, later)."""
    end_s: float
    """Virtual time of the last event."""
    wall_s: float
    """Wall-clock seconds the run took (the event loop only: building the fleet and registering it with
    each core is start-up, not counted)."""
    cpu_s: float
    """CPU seconds of this process over the same span (what a loaded machine does not distort)."""
    events: int

    def summary(self) -> dict[str, Any]:
        """The JSON-ready report of this run."""
        return summarize(self)


def outcome_shares(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """`outcome_counts` plus SLO attainment, shed, lost and expired shares (percent of offered)."""
    counts = outcome_counts(records, duration_s)
    offered = max(1, len(records))
    lost = sum(1 for r in records if r.reason == "worker_lost")
    shed = sum(1 for r in records if r.code in SHED_CODES and r.reason != "worker_lost")
    expired = sum(1 for r in records if r.code == "DEADLINE_EXCEEDED")
    counts.update(
        slo_pct=100.0 * counts["good"] / offered, shed_pct=100.0 * shed / offered,
        lost_pct=100.0 * lost / offered, expired_pct=100.0 * expired / offered,
    )  # fmt: skip
    return counts


def _workers(result: SimResult) -> dict[str, Any]:
    span = max(result.end_s, 1e-9)
    rows = [w.rows for w in result.workers]
    detail = [
        {"id": w.worker_id, "speed": w.speed, "batches": w.batches, "rows": w.rows,
         "busy": w.busy_s / span}
        for w in result.workers
    ] if len(result.workers) <= WORKER_DETAIL_UP_TO else []  # fmt: skip
    by_speed: dict[str, dict[str, float]] = {}
    for w in result.workers:
        group = by_speed.setdefault(f"{w.speed:g}", {"workers": 0, "batches": 0, "rows": 0, "busy_s": 0.0})
        group["workers"] += 1
        group["batches"] += w.batches
        group["rows"] += w.rows
        group["busy_s"] += w.busy_s
    return {
        "count": len(result.workers),
        "rows_per_worker": {"min": min(rows), "mean": float(np.mean(rows)), "max": max(rows)},
        "busy_mean": sum(w.busy_s for w in result.workers) / span / len(result.workers),
        "max_held": max(w.max_held for w in result.workers),
        "by_speed": by_speed,
        "detail": detail,
    }


def tenant_figures(result: SimResult) -> dict[str, Any]:
    """Each tenant with a quota: its limit, offered and admitted (not refused by a quota) and OK rates
    over the whole run, and admitted as a share of its limit."""
    scenario = result.plan.scenario
    duration = scenario.duration_s
    figures = {}
    for name, quota in scenario.quotas.items():
        records = [r for r in result.records if scenario.classes[r.cls].tenant == name]
        admitted = sum(1 for r in records if r.reason not in QUOTA_REASONS)
        figures[name] = {
            "limit_rps": quota.rate, "offered_rps": len(records) / duration,
            "admitted_rps": admitted / duration, "ok_rps": sum(1 for r in records if r.ok) / duration,
            "admitted_of_limit_pct": 100.0 * admitted / duration / quota.rate,
        }  # fmt: skip
    return figures


def summarize(result: SimResult) -> dict[str, Any]:
    """The run's report: totals, per class, batches, workers and the simulator's own speed."""
    plan = result.plan
    scenario = plan.scenario
    duration = scenario.duration_s
    classes = [[r for r in result.records if r.cls == k] for k in range(len(scenario.classes))]
    batches = result.batch_rows
    return {
        "variant": plan.variant,
        "policy": plan.policy.model_dump(),
        "rate": plan.rate,
        "capacity_rps": plan.capacity_rps,
        "load": plan.rate / plan.capacity_rps,
        "arrivals": plan.arrivals,
        "total": outcome_shares(result.records, duration),
        "classes": {
            c.name: outcome_shares(group, duration)
            for c, group in zip(scenario.classes, classes, strict=True)
        },
        "batches": {
            "count": len(batches),
            "mean_rows": float(np.mean(batches)) if batches else 0.0,
            "p50_rows": float(np.percentile(batches, 50)) if batches else 0.0,
            "mean_forward_rows": float(np.mean(result.forward_rows)) if result.forward_rows else 0.0,
            "cut_reasons": dict(sorted(result.cut_reasons.items())),
            "late_rows_pct": 100.0 * result.late_rows / max(1, sum(w.rows for w in result.workers)),
            "redispatched": result.redispatched,
        },
        "workers": _workers(result),
        "tenants": tenant_figures(result),
        "sim": {
            "wall_s": result.wall_s,
            "cpu_s": result.cpu_s,
            "events": result.events,
            "virtual_end_s": result.end_s,
            "requests_per_wall_s": plan.arrivals / max(result.wall_s, 1e-9),
            "requests_per_cpu_s": plan.arrivals / max(result.cpu_s, 1e-9),
        },
    }


COLUMNS: Final = ["variant", "offered/s", "load", "ok/s", "good/s", "SLO %", "shed %", "expired %",
           "p50 ms", "p99 ms", "batch"]  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table_row(summary: dict[str, Any], cls: str | None = None) -> list[str]:
    """One table row: the totals, or one class's figures when `cls` is given."""
    c = summary["total"] if cls is None else summary["classes"][cls]
    lat = c["latency_ms"]
    return [
        summary["variant"], f"{c['offered_rps']:.0f}", f"{summary['load']:.2f}", f"{c['throughput_rps']:.0f}",
        f"{c['goodput_rps']:.0f}", f"{c['slo_pct']:.1f}", f"{c['shed_pct']:.1f}", f"{c['expired_pct']:.1f}",
        _ms(lat["p50"]), _ms(lat["p99"]), f"{summary['batches']['mean_rows']:.1f}",
    ]  # fmt: skip


def format_table(rows: list[list[str]], *, markdown: bool = False, columns: list[str] | None = None) -> str:
    """Fixed-width text, or a Markdown table for docs."""
    header = columns or COLUMNS
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    )


def worker_table(summary: dict[str, Any], *, markdown: bool = False) -> str:
    """Per-worker batches, rows and busy fraction (small fleets only)."""
    rows = [[w["id"], f"{w['speed']:g}", str(w["batches"]), str(w["rows"]), f"{100 * w['busy']:.0f}"]
            for w in summary["workers"]["detail"]]  # fmt: skip
    return format_table(rows, markdown=markdown, columns=["worker", "speed", "batches", "rows", "busy %"])
