"""bench/peer_report.py: a sitting's points, of a rate's tries the least disturbed by other work."""

from __future__ import annotations

import json
from pathlib import Path

from sluice_inference.bench.peer_report import overload_summary, read_points, table


def _line(offered: float, goodput: float, other: float | None) -> str:
    data = {
        "offered_rps": offered, "achieved_rps": offered, "goodput_rps": goodput, "p50_ms": 7.0,
        "p99_ms": 30.0, "errors": 0, "timeouts": 0, "server_cpu_frac": 0.8,
    }  # fmt: skip
    if other is not None:
        data["other_cpu_frac"] = other
    return json.dumps(data)


def _sitting(tmp_path: Path, lines: list[str]) -> Path:
    folder = tmp_path / "t2"
    (folder / "sluice").mkdir(parents=True)
    ready = json.dumps({"label": "sluice", "ready_s": 3.0})
    (folder / "sluice" / "sluice.jsonl").write_text("\n".join([ready, *lines]) + "\n")
    return folder


def test_a_rate_keeps_its_least_disturbed_try(tmp_path: Path) -> None:
    folder = _sitting(
        tmp_path,
        [_line(1000, 1000, 0.01), _line(1200, 600, 0.30), _line(1200, 1195, 0.02), _line(1200, 700, 0.02)],
    )

    points = read_points(folder)["sluice"]

    assert [(p.offered, p.goodput, p.tries) for p in points] == [(1000, 1000, 1), (1200, 1195, 3)]
    assert not any(p.disturbed for p in points)
    assert "holds the SLO to 1200/s" in overload_summary("sluice", points)


def test_a_rate_disturbed_in_every_try_is_marked(tmp_path: Path) -> None:
    folder = _sitting(tmp_path, [_line(1000, 1000, 0.01), _line(1200, 500, 0.33), _line(1200, 900, 0.12)])

    points = read_points(folder)["sluice"]

    assert points[1].goodput == 900 and points[1].disturbed
    assert "| 0.12 disturbed | 2 |" in table("sluice", points)
    assert "disturbed by other work at 1200/s (0.12 of a core)" in overload_summary("sluice", points)


def test_points_without_the_other_work_figure_are_not_disturbed(tmp_path: Path) -> None:
    points = read_points(_sitting(tmp_path, [_line(1000, 1000, None)]))["sluice"]

    assert not points[0].disturbed
    assert "| - | 1 |" in table("sluice", points)
    assert "disturbed" not in overload_summary("sluice", points)
