"""CPU per request against mean rows per batch (issue 17): how much of the router's and the worker's CPU is
per batch, and so what larger batches buy.

Runs bench/hop_cpu.py once per `--base-ms` (a fresh cluster each time, the same offered `--rate`): the
`synthetic` model sleeps that long per forward and spends no CPU on it, so the longer the forward, the more
requests arrive during it and join the next batch. From the points it fits, per process and for both
together, CPU per request = c0 + c1 / rows (least squares): c0 is what every request costs whatever the
batching, c1 what a batch costs (spread over its rows). With `--plot` it draws the points and the fits.

    python -m sluice_inference.bench.rows_sweep --rate 300 --base-ms 1 5 10 20 40 --plot docs/figures/rows.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from sluice_inference.bench import hop_cpu

PROCESSES = ("router", "worker-1")


def fit(rows: list[float], cpu_ms: list[float]) -> tuple[float, float]:
    """Least-squares (c0, c1) of cpu = c0 + c1 / rows."""
    design = np.column_stack([np.ones(len(rows)), 1.0 / np.asarray(rows)])
    (c0, c1), *_ = np.linalg.lstsq(design, np.asarray(cpu_ms), rcond=None)
    return float(c0), float(c1)


def measure(rate: float, base_ms: float, seconds: float) -> dict[str, Any]:
    """One hop_cpu run; its figures."""
    with tempfile.TemporaryDirectory(prefix="sluice-rows-") as folder:
        out = Path(folder) / "figures.json"
        hop_cpu.main(
            ["--rate", str(rate), "--base-ms", str(base_ms), "--seconds", str(seconds), "--json", str(out)]
        )
        figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def plot(points: list[dict[str, Any]], fits: dict[str, tuple[float, float]], path: Path) -> None:
    """Points and fitted curves, CPU ms per request against rows per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [p["rows_per_batch"] for p in points]
    grid = np.linspace(min(rows), max(rows), 100)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (c0, c1) in fits.items():
        ax.plot(grid, c0 + c1 / grid, label=f"{name}: {c0:.2f} + {c1:.2f}/rows ms")
        ax.scatter(rows, [total_or(p, name) for p in points], s=14)
    ax.set_xlabel("mean rows per batch")
    ax.set_ylabel("CPU ms per request")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"Sluice at {points[0]['rate']:.0f} req/s, synthetic model (no forward CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def total_or(point: dict[str, Any], name: str) -> float:
    """A point's CPU ms per request for one process, or for both ("router + worker")."""
    cpu: dict[str, float] = point["cpu_ms_per_request"]
    return sum(cpu[p] for p in PROCESSES) if name == "router + worker" else cpu[name]


def main(argv: list[str] | None = None) -> int:
    """Measure each point, print them and the fits, draw them if asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=300.0, help="offered requests per second (default 300)")
    parser.add_argument("--base-ms", type=float, nargs="+", default=[1.0, 5.0, 10.0, 20.0, 40.0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per point (default 10)")
    parser.add_argument("--plot", type=Path, help="draw the points and fits here (PNG)")
    args = parser.parse_args(argv)
    points = [measure(args.rate, base_ms, args.seconds) for base_ms in args.base_ms]
    print("| forward ms | rows per batch | router ms/req | worker ms/req |")
    print("|---|---|---|---|")
    for p in points:
        cpu = p["cpu_ms_per_request"]
        print(
            f"| {p['base_ms']:g} | {p['rows_per_batch']:.2f} | {cpu['router']:.3f} | {cpu['worker-1']:.3f} |"
        )
    rows = [p["rows_per_batch"] for p in points]
    fits = {name: fit(rows, [total_or(p, name) for p in points]) for name in (*PROCESSES, "router + worker")}
    for name, (c0, c1) in fits.items():
        print(f"{name}: {c0:.3f} ms per request + {c1:.3f} ms per batch")
    if args.plot:
        plot(points, fits, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
