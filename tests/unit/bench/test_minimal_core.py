"""The minimal policy core (bench/sim/minimal_core.py): the floor its rate stands for holds only if it keeps
the promises the real core keeps — every request ends exactly once, within its deadline or with its status,
and priorities are served first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluice_inference.bench.sim.minimal_core import EXPIRED, OK, REFUSED, keep_up_rows, main, run_minimal
from sluice_inference.bench.sim.plan import plan_run
from sluice_inference.bench.sim.scenario import parse_sim_scenario

SCENARIOS = Path(__file__).resolve().parents[3] / "bench" / "scenarios"


def plan(**fields: Any) -> Any:
    base: dict[str, Any] = {
        "duration_s": 1, "load": 0.5, "seed": 5, "workers": [{"count": 4}],
        "classes": [{"name": "app", "deadline_ms": 100}],
        "noise": {"sigma": 0.1, "stall_p": 0.01, "stall_ms": 30},
    }  # fmt: skip
    return plan_run(parse_sim_scenario({**base, **fields}))


def test_at_half_load_every_request_is_served_once_within_its_deadline() -> None:
    run = plan()
    result = run_minimal(run)
    assert result.requests == run.arrivals > 1000
    assert set(result.ended) == {OK}
    assert max(result.latencies_s) <= 0.1
    assert 1 < result.mean_batch <= 32


def test_overload_ends_every_request_with_a_status_and_serves_the_better_priority_first() -> None:
    classes = [
        {"name": "gold", "weight": 1, "tenant": "gold", "priority": 1, "deadline_ms": 100},
        {"name": "bronze", "weight": 1, "tenant": "bronze", "priority": 3, "deadline_ms": 100},
        {"name": "hopeless", "weight": 0.1, "tenant": "gold", "priority": 1, "deadline_ms": 1},
    ]
    run = plan(load=1.6, classes=classes)
    result = run_minimal(run)
    assert -1 not in result.ended  # each request ended (each index is written once, by `end`)
    by_class: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for cls, how in zip(run.classes, result.ended, strict=True):
        by_class[cls].append(how)
    assert set(by_class[2]) == {REFUSED}  # a 1 ms budget cannot cover a batch: refused at once
    gold_ok = by_class[0].count(OK) / len(by_class[0])
    bronze_ok = by_class[1].count(OK) / len(by_class[1])
    assert gold_ok > 0.95 and bronze_ok < 0.5, (gold_ok, bronze_ok)
    assert EXPIRED in by_class[1]  # what waited past its deadline ended with its status, not served late
    served = [s for s, how in zip(result.latencies_s, result.ended, strict=True) if how == OK]
    assert max(served) <= 0.1  # never OK after the deadline


def test_the_target_is_the_keep_up_batch_and_full_when_overloaded() -> None:
    light, heavy = plan(load=0.1), plan(load=1.2)
    assert 1 <= keep_up_rows(light.scenario, light.rate) < keep_up_rows(heavy.scenario, heavy.rate) == 32


def test_the_command_prints_both_rates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(SCENARIOS / "sim_scale.yaml"), "--duration", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "minimal core:" in out and "sluice sim:" in out and "ratio:" in out
