"""What a load run measured: one record per scheduled request, and the summary built from them (pure).

Definitions (docs/loadgen.md repeats them):
- offered: requests scheduled; rates divide counts by the scenario's `duration_s`;
- ok: answered with status OK; good: OK within the class's deadline; late OK: OK after it (the server
  promised the deadline, so Sluice should have none);
- rejected: every other outcome, counted by `STATUS/reason` (reason = the `sluice-reason` trailer, `-` when
  absent, e.g. a transport failure); `with_hint` counts those that carried a retry hint;
- latency: from the moment the request was actually sent to its answer, OK requests only; rejections get
  their own percentiles per `STATUS/reason` (how soon a refused client learns it should retry);
- send lag: actual send time minus scheduled time (how well the generator keeps its schedule);
- timeline: per second of *scheduled* time, so a request counts in the second it was offered.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

PERCENTILES: Final = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}
OK: Final = "OK"


@dataclass(slots=True)
class RequestRecord:
    """The outcome of one scheduled request. Nothing changes one once built; not frozen all the same: a
    frozen dataclass's `__init__` sets each field through `object.__setattr__`, and one is built per request
    (per simulated request too, where building them frozen took ~2 % of a run)."""

    cls: int
    """Index of its traffic class."""
    scheduled_s: float
    """When it was due, seconds from the start of the schedule."""
    lag_s: float
    """Actual send time minus `scheduled_s`."""
    latency_s: float
    """From the actual send to the answer (or the error)."""
    code: str
    """`OK` or the gRPC status name (`CLIENT_ERROR` when the generator itself failed to send it)."""
    deadline_s: float
    """The class's deadline."""
    reason: str = ""
    """The `sluice-reason` trailer of a rejection."""
    hint: bool = False
    """A retry hint (RetryInfo or a non-negative pushback) came with the rejection."""
    detail: str = ""
    """The status message of a rejection (the report keeps one example per status/reason)."""
    cache: str = ""
    """The response's `sluice_cache` (hit, miss, bypass; empty when the model is not cached)."""

    def __init__(  # noqa: PLR0917 (positional, as the dataclass's own `__init__` takes them)
        self,
        cls: int,
        scheduled_s: float,
        lag_s: float,
        latency_s: float,
        code: str,
        deadline_s: float,
        reason: str = "",
        hint: bool = False,
        detail: str = "",
        cache: str = "",
    ) -> None:
        # Written out: mypyc compiles this, not a dataclass's generated `__init__` (common/compiled_core.py).
        self.cls = cls
        self.scheduled_s = scheduled_s
        self.lag_s = lag_s
        self.latency_s = latency_s
        self.code = code
        self.deadline_s = deadline_s
        self.reason = reason
        self.hint = hint
        self.detail = detail
        self.cache = cache

    @property
    def ok(self) -> bool:
        """Answered OK."""
        return self.code == OK

    @property
    def good(self) -> bool:
        """Answered OK within its deadline."""
        return self.ok and self.latency_s <= self.deadline_s


@dataclass(frozen=True)
class ClassLabel:
    """How the report names a traffic class."""

    name: str
    tenant: str
    priority: int
    model: str


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99/p99.9 in milliseconds (linear interpolation); None when there are no samples."""
    if not seconds:
        return dict.fromkeys(PERCENTILES)
    values = np.percentile(np.asarray(seconds) * 1000.0, list(PERCENTILES.values()))
    return {key: float(v) for key, v in zip(PERCENTILES, values, strict=True)}


def _status_key(r: RequestRecord) -> str:
    return f"{r.code}/{r.reason or '-'}"


def outcome_counts(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Counts, rates, rejections and OK latency percentiles of one group of records."""
    ok = [r for r in records if r.ok]
    good = sum(1 for r in ok if r.good)
    rejected = [r for r in records if not r.ok]
    by_status = Counter(_status_key(r) for r in rejected)
    examples: dict[str, str] = {}
    refused_after: dict[str, list[float]] = {}
    for r in rejected:
        examples.setdefault(_status_key(r), r.detail)
        refused_after.setdefault(_status_key(r), []).append(r.latency_s)
    return {
        "offered": len(records),
        "offered_rps": len(records) / duration_s,
        "ok": len(ok),
        "throughput_rps": len(ok) / duration_s,
        "good": good,
        "goodput_rps": good / duration_s,
        "late_ok": len(ok) - good,
        "rejected": len(rejected),
        "rejected_by_status": dict(by_status.most_common()),
        "rejected_with_hint": sum(1 for r in rejected if r.hint),
        "rejection_examples": examples,
        "rejection_latency_ms": {key: percentiles_ms(seconds) for key, seconds in refused_after.items()},
        "latency_ms": percentiles_ms([r.latency_s for r in ok]),
        "latency_mean_ms": 1000.0 * sum(r.latency_s for r in ok) / len(ok) if ok else None,
        "cache": {
            outcome: {"count": len(group), "latency_ms": percentiles_ms([r.latency_s for r in group])}
            for outcome in ("hit", "miss", "bypass")
            if (group := [r for r in ok if r.cache == outcome])
        },
    }


def timeline(records: Sequence[RequestRecord], duration_s: float) -> dict[str, list[int]]:
    """Per second of scheduled time: offered, ok, good and rejected counts."""
    seconds = max(1, math.ceil(duration_s))
    series = {key: [0] * seconds for key in ("offered", "ok", "good", "rejected")}
    for r in records:
        second = min(seconds - 1, int(r.scheduled_s))
        series["offered"][second] += 1
        series["ok" if r.ok else "rejected"][second] += 1
        if r.good:
            series["good"][second] += 1
    return {"t_s": list(range(seconds)), **series}


def send_lag_ms(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Percentiles and the maximum of the send lag."""
    lags = [r.lag_s for r in records]
    return {**percentiles_ms(lags), "max": max(lags) * 1000.0 if lags else None}


def achieved_send_rps(records: Sequence[RequestRecord], duration_s: float) -> float:
    """Requests sent per second of the time taken to send them (never less than the scheduled duration)."""
    if not records:
        return 0.0
    last_send = max(r.scheduled_s + r.lag_s for r in records)
    return len(records) / max(duration_s, last_send)


def summarize(
    records: Sequence[RequestRecord], labels: Sequence[ClassLabel], duration_s: float
) -> dict[str, Any]:
    """The run's report: per class, totals, send lag and the per-second timeline (JSON-ready)."""
    by_class: list[list[RequestRecord]] = [[] for _ in labels]
    for r in records:
        by_class[r.cls].append(r)
    classes = [
        {"name": label.name, "tenant": label.tenant, "priority": label.priority, "model": label.model,
         **outcome_counts(group, duration_s)}
        for label, group in zip(labels, by_class, strict=True)
    ]  # fmt: skip
    return {
        "duration_s": duration_s,
        "classes": classes,
        "total": outcome_counts(records, duration_s),
        "send_lag_ms": send_lag_ms(records),
        "achieved_send_rps": achieved_send_rps(records, duration_s),
        "timeline": {
            "total": timeline(records, duration_s),
            "by_class": {
                label.name: timeline(g, duration_s) for label, g in zip(labels, by_class, strict=True)
            },
        },
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if value >= 100 else f"{value:.2f}"


def _row(name: str, tenant: str, priority: str, c: dict[str, Any]) -> list[str]:
    lat = c["latency_ms"]
    rejections = ", ".join(f"{k}={v}" for k, v in c["rejected_by_status"].items()) or "-"
    return [
        name, tenant, priority, f"{c['offered_rps']:.1f}", f"{c['throughput_rps']:.1f}",
        f"{c['goodput_rps']:.1f}", str(c["late_ok"]), *(_ms(lat[p]) for p in PERCENTILES), rejections,
    ]  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    """The report as a fixed-width table, one row per class, then totals and the send lag."""
    header = ["class", "tenant", "prio", "offered/s", "ok/s", "good/s", "late_ok",
              "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "rejections (status/reason=count)"]  # fmt: skip
    rows = [_row(c["name"], c["tenant"], str(c["priority"]), c) for c in report["classes"]]
    rows.append(_row("total", "", "", report["total"]))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
             for row in [header, *rows]]  # fmt: skip
    for key, refused in report["total"]["rejection_latency_ms"].items():
        lines.append(f"{key} answered after p50 {_ms(refused['p50'])} ms, p99 {_ms(refused['p99'])} ms")
    lag = report["send_lag_ms"]
    lines.append(
        f"send lag p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms, max {_ms(lag['max'])} ms; "
        f"sent {report['achieved_send_rps']:.1f} req/s over {report['duration_s']:g} s"
    )
    return "\n".join(lines)
