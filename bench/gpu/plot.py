"""The kit's one figure: (left) the device's own curve, items/s against batch size per sequence bucket;
(right) Sluice's goodput against the offered rate, batching on and off, under the in-process bound.

With matplotlib (as bench/peer_report.py draws its figures) the plot has axes, labels and a legend. The
GPU machine may lack it, and its wheels would not fit the kit's 64 MiB, so without it the same lines are
drawn by a small raster writer here (PNG is zlib-compressed scanlines plus three chunks): lines and axes
only, no text; `draw` says which was used, and the JSON holds every value plotted.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from pathlib import Path
from typing import Any

Series = tuple[str, list[tuple[float, float]]]
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def panels(figures: dict[str, Any]) -> tuple[list[Series], list[Series], float | None]:
    """The curve's series per bucket, the end-to-end series per model, and the best in-process bound."""
    curve: dict[int, list[tuple[float, float]]] = {}
    for cell in figures.get("device_curve", {}).get("points", []):
        curve.setdefault(cell["bucket"], []).append((cell["batch"], cell["items_per_s"]))
    e2e: dict[str, list[tuple[float, float]]] = {}
    for step in figures.get("end_to_end", {}).get("steps", []):
        e2e.setdefault(step["model"], []).append((step["rate"], step["goodput_rps"]))
    bound = figures.get("end_to_end", {}).get("in_process_bound_items_per_s")
    return [(f"L={b}", pts) for b, pts in sorted(curve.items())], sorted(e2e.items()), bound


def draw(figures: dict[str, Any], path: Path) -> str:
    """Write the figure to `path`; returns how ("matplotlib" or "built-in writer, no text")."""
    curve, e2e, bound = panels(figures)
    try:
        import matplotlib
    except ImportError:
        write_png(path, raster(curve, e2e, bound))
        return (
            "built-in writer, no text (matplotlib is not installed): left, items/s by batch per bucket; "
            "right, goodput by offered rate per model, the in-process bound dashed"
        )
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in curve:
        left.plot(*zip(*points, strict=True), marker="o", label=label)
    left.set(xscale="log", xlabel="batch size", ylabel="items/s", title="in-process forward (device curve)")
    left.legend()
    for label, points in e2e:
        right.plot(*zip(*points, strict=True), marker="o", label=label)
    if bound:
        right.axhline(bound, linestyle="--", color="grey", label="in-process bound")
    right.set(xlabel="offered requests/s", ylabel="goodput (OK within SLO)/s", title="through Sluice")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def raster(curve: list[Series], e2e: list[Series], bound: float | None) -> list[bytearray]:
    """Two 400x300 panels side by side, white background, black axes, one colour per series."""
    width, height = 820, 320
    rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    _panel(rows, (10, 10, 400, 300), [(n, [(math.log2(x), y) for x, y in p]) for n, p in curve], None)
    _panel(rows, (420, 10, 400, 300), e2e, bound)
    return rows


def _panel(
    rows: list[bytearray], box: tuple[int, int, int, int], series: list[Series], hline: float | None
) -> None:
    left, top, width, height = box
    _line(rows, (left, top + height), (left + width, top + height), (0, 0, 0))
    _line(rows, (left, top), (left, top + height), (0, 0, 0))
    points = [pt for _, pts in series for pt in pts]
    if not points:
        return
    x_hi = max(x for x, _ in points) or 1.0
    x_lo = min(x for x, _ in points)
    y_hi = max([y for _, y in points] + ([hline] if hline else [])) * 1.05 or 1.0

    def at(x: float, y: float) -> tuple[int, int]:
        span = (x_hi - x_lo) or 1.0
        return left + round((x - x_lo) / span * (width - 1)), top + height - round(y / y_hi * (height - 1))

    if hline:
        _, y = at(x_lo, hline)
        for x in range(left, left + width, 8):
            _line(rows, (x, y), (x + 4, y), (128, 128, 128))
    for index, (_, pts) in enumerate(series):
        colour = COLOURS[index % len(COLOURS)]
        corners = [at(x, y) for x, y in sorted(pts)]
        for (x0, y0), (x1, y1) in itertools.pairwise(corners):
            _line(rows, (x0, y0), (x1, y1), colour)
        for x, y in corners:
            for dx in range(-2, 3):
                _line(rows, (x + dx, y - 2), (x + dx, y + 2), colour)


def _line(
    rows: list[bytearray], start: tuple[int, int], end: tuple[int, int], colour: tuple[int, int, int]
) -> None:
    """Bresenham's line, clipped to the canvas."""
    (x0, y0), (x1, y1) = start, end
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    error = dx + dy
    while True:
        if 0 <= y0 < len(rows) and 0 <= x0 < len(rows[0]) // 3:
            rows[y0][3 * x0 : 3 * x0 + 3] = bytes(colour)
        if x0 == x1 and y0 == y1:
            return
        double = 2 * error
        if double >= dy:
            error, x0 = error + dy, x0 + sx
        if double <= dx:
            error, y0 = error + dx, y0 + sy


def write_png(path: Path, rows: list[bytearray]) -> None:
    """An 8-bit RGB PNG of `rows` (each 3 x width bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", len(rows[0]) // 3, len(rows), 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\x00" + bytes(row) for row in rows), 9)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )
