"""PNG figures of sweeps: goodput and p99 against offered load, one line per variant (optional).

matplotlib is imported only when a figure is drawn, with the Agg backend (no display needed), so the
simulator and its tests run without it; `PlotUnavailable` says how to install it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "plots need matplotlib: pip install -c constraints.txt matplotlib (or the dev extra)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(summaries: Sequence[dict[str, Any]], cls: str | None) -> dict[str, list[tuple[float, ...]]]:
    lines: dict[str, list[tuple[float, ...]]] = {}
    for s in summaries:
        c = s["total"] if cls is None else s["classes"][cls]
        p99 = c["latency_ms"]["p99"]
        point = (s["load"], c["goodput_rps"], float("nan") if p99 is None else p99, c["shed_pct"])
        lines.setdefault(s["variant"], []).append(point)
    return {name: sorted(points) for name, points in lines.items()}


def plot_sweep(
    summaries: Sequence[dict[str, Any]], path: Path, *, title: str, cls: str | None = None
) -> Path:
    """Goodput, p99 and shed share against offered load (x capacity), one line per variant."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=80)
    what = "all classes" if cls is None else f"class {cls}"
    for name, points in _series(summaries, cls).items():
        load = [p[0] for p in points]
        axes[0].plot(load, [p[1] for p in points], marker="o", markersize=3, label=name)
        axes[1].plot(load, [p[2] for p in points], marker="o", markersize=3, label=name)
        axes[2].plot(load, [p[3] for p in points], marker="o", markersize=3, label=name)
    labels = [f"goodput, req/s ({what})", "p99 latency of OK answers, ms", "shed, % of offered"]
    for ax, label in zip(axes, labels, strict=True):
        ax.set_xlabel("offered load (x fleet capacity at full batches)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_worker_share(summaries: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Rows per worker of each run, grouped by variant (small fleets)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.4), dpi=80)
    width = 0.8 / max(1, len(summaries))
    for k, s in enumerate(summaries):
        detail = s["workers"]["detail"]
        xs = [i + k * width for i in range(len(detail))]
        ax.bar(xs, [w["rows"] for w in detail], width=width, label=s["variant"])
        if k == 0:
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(detail))])
            ax.set_xticklabels([f"{w['id']} (speed {w['speed']:g})" for w in detail], fontsize=8)
    ax.set_ylabel("rows executed")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
