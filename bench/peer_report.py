"""Tables and overload curves from one sitting of `bench/peer_sitting.sh`.

The sitting leaves `OUT/t<timeout>/<label>/<peer>.jsonl` (the shared harness's lines: offered, achieved
and good rates, percentiles, errors, timeouts, the server's CPU and the CPU other work on the machine took
meanwhile). A point that other work disturbed (over `DISTURBED` of a core) is run again by the sitting;
of the tries at one rate the report keeps the least disturbed, and marks a kept point that is still
disturbed. Per client timeout this prints one markdown table per system, then, for the goals of issue
11, each system's saturation rate (the highest with at least 99 % within the SLO) with its CPU per
request, its peak goodput, and its goodput at 2x and 4x the saturation rate (the nearest measured
rates), and draws goodput and p99 against the offered rate (`--plot`).

    python -m sluice_inference.bench.peer_report /tmp/sitting --plot docs/figures/peers.png
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DISTURBED = 0.05
"""Other work on the machine above this share of a core during a point makes the point disturbed: a burst
of other work makes a 15 s run's tail while its average stays small (`bench/peer_sitting.sh` runs such a
point again, `OTHER_MAX`)."""


@dataclass(frozen=True)
class Point:
    """One measured rate of one system."""

    offered: float
    achieved: float
    goodput: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    timeouts: int
    cpu: float | None
    """Cores the server used."""
    refusals: dict[str, int]
    other: float | None = None
    """Cores other work on the machine used meanwhile (None: not recorded)."""
    tries: int = 1
    """Runs at this rate, this one the least disturbed (`kept`)."""

    @property
    def disturbed(self) -> bool:
        """Whether other work took more than `DISTURBED` of a core during the point."""
        return self.other is not None and self.other > DISTURBED

    @property
    def within_slo(self) -> float:
        """Share of the offered requests answered OK within the SLO."""
        return self.goodput / self.offered if self.offered else 0.0

    @property
    def cpu_per_request_ms(self) -> float | None:
        """Server CPU per OK answer."""
        if self.cpu is None or not self.achieved:
            return None
        return self.cpu / self.achieved * 1000


def read_points(folder: Path) -> dict[str, list[Point]]:
    """Points per system label under one timeout's folder, by offered rate."""
    systems: dict[str, list[Point]] = {}
    for path in sorted(folder.glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            data: dict[str, Any] = json.loads(line)
            if "offered_rps" not in data:
                continue  # the harness's "ready" line
            protocol = data.get("protocol", "grpc")
            label = path.parent.name if protocol == "grpc" else f"{path.parent.name} ({protocol})"
            systems.setdefault(label, []).append(
                Point(
                    offered=data["offered_rps"],
                    achieved=data["achieved_rps"],
                    goodput=data["goodput_rps"],
                    p50_ms=data.get("p50_ms"),
                    p99_ms=data.get("p99_ms"),
                    errors=data["errors"],
                    timeouts=data["timeouts"],
                    cpu=data.get("server_cpu_frac"),
                    refusals=data.get("error_kinds", {}),
                    other=data.get("other_cpu_frac"),
                )
            )
    return {label: kept(points) for label, points in systems.items()}


def kept(points: list[Point]) -> list[Point]:
    """One point per offered rate, by rate: of a rate's tries the least disturbed (the first of equals),
    counting the tries."""
    by_rate: dict[float, list[Point]] = {}
    for point in points:
        by_rate.setdefault(point.offered, []).append(point)
    return [
        replace(min(tries, key=lambda p: p.other or 0.0), tries=len(tries))
        for _, tries in sorted(by_rate.items())
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(label: str, points: list[Point]) -> str:
    """One system's rows."""
    rows = [
        f"**{label}**",
        "",
        "| offered/s | OK/s | within SLO/s | within SLO | p50 / p99 ms | errors | timeouts | server CPU "
        "| CPU per OK | other CPU | tries |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        other = "-" if p.other is None else f"{p.other:.2f}{' disturbed' if p.disturbed else ''}"
        rows.append(
            f"| {p.offered:.0f} | {p.achieved:.0f} | {p.goodput:.0f} | {p.within_slo:.1%} | "
            f"{_ms(p.p50_ms)} / {_ms(p.p99_ms)} | {p.errors} | {p.timeouts} | "
            f"{'-' if p.cpu is None else f'{p.cpu:.2f}'} | {_per(p)} | {other} | {p.tries} |"
        )
    return "\n".join(rows)


def saturation(points: list[Point]) -> Point | None:
    """The highest measured rate with at least 99 % of the offered requests answered OK within the SLO."""
    held = [p for p in points if p.within_slo >= 0.99]
    return max(held, key=lambda p: p.offered) if held else None


def overload_summary(label: str, points: list[Point]) -> str:
    """The saturation rate and its CPU per request, the peak goodput, and the goodput at the measured rates
    nearest 2x and 4x the saturation rate, as a share of the peak (issue 11's no-collapse goal)."""
    peak = max(points, key=lambda p: p.goodput)
    held = saturation(points)
    base = held or peak
    parts = [
        f"{label}: holds the SLO to {held.offered:.0f}/s ({_per(held)} CPU per request)"
        if held
        else f"{label}: never 99 % within the SLO",
        f"peak {peak.goodput:.0f}/s within SLO at {peak.offered:.0f} offered",
    ]
    disturbed = [p for p in points if p.disturbed]
    if disturbed:
        shares = ", ".join(f"{p.offered:.0f}/s ({p.other:.2f} of a core)" for p in disturbed)
        parts.append(f"disturbed by other work at {shares}")
    shown = {base.offered}
    for multiple in (2, 4):
        point = min(points, key=lambda p: abs(p.offered - multiple * base.offered))
        if point.offered not in shown and point.offered > base.offered:
            shown.add(point.offered)
            share = point.goodput / peak.goodput if peak.goodput else 0.0
            parts.append(
                f"at {point.offered:.0f} offered ({point.offered / base.offered:.1f}x): {share:.0%} of peak"
            )
    return "; ".join(parts)


def _per(point: Point) -> str:
    per = point.cpu_per_request_ms
    return "-" if per is None else f"{per:.2f} ms"


def plot(sitting: Path, timeouts: list[str], path: Path) -> None:
    """Goodput and p99 against offered load, one column per client timeout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(timeouts), figsize=(6 * len(timeouts), 8), squeeze=False)
    for column, timeout in enumerate(timeouts):
        for label, points in read_points(sitting / f"t{timeout}").items():
            offered = [p.offered for p in points]
            axes[0][column].plot(offered, [p.goodput for p in points], marker="o", label=label)
            answered = [p for p in points if p.p99_ms is not None]  # no OK answer: no p99 to draw
            axes[1][column].plot(
                [p.offered for p in answered], [p.p99_ms for p in answered], marker="o", label=label
            )
        axes[0][column].set_title(f"client timeout {timeout} s: OK within 50 ms per second")
        axes[1][column].set_title(f"client timeout {timeout} s: p99 of OK answers (ms)")
        axes[1][column].set_yscale("log")
        for row in (0, 1):
            axes[row][column].set_xlabel("offered req/s (one core for the server)")
            axes[row][column].legend()
            axes[row][column].grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sitting", type=Path, help="the folder bench/peer_sitting.sh wrote")
    parser.add_argument("--plot", type=Path, help="also draw the curves into this PNG")
    args = parser.parse_args()
    timeouts = sorted((p.name[1:] for p in args.sitting.glob("t*") if p.is_dir()), key=float, reverse=True)
    for timeout in timeouts:
        print(f"## client timeout {timeout} s\n")
        systems = read_points(args.sitting / f"t{timeout}")
        for label, points in systems.items():
            print(table(label, points) + "\n")
        for label, points in systems.items():
            print("- " + overload_summary(label, points))
        print()
    if args.plot is not None:
        plot(args.sitting, timeouts, args.plot)


if __name__ == "__main__":
    main()
