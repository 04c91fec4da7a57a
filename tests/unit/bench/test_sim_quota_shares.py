"""Quota shares in the simulator: 20 routers, tenants placed on one router, on a few, on all, or under
their limit; the same router cores as the server, exchanging demand with a delay. Virtual time only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluice_inference.bench.loadgen_scenario import ScenarioError
from sluice_inference.bench.quota_shares import main as bench_main
from sluice_inference.bench.sim.engine import simulate
from sluice_inference.bench.sim.plan import plan_run
from sluice_inference.bench.sim.results import QUOTA_REASONS
from sluice_inference.bench.sim.scenario import load_sim_scenario, parse_sim_scenario

SCENARIO = Path(__file__).resolve().parents[3] / "bench" / "scenarios" / "sim_quota_shares.yaml"
SETTLE_S = 1.5
"""Shares converge from the cold start within about a second; rates are read after this."""


def admitted_rates(mode: str, duration_s: float = 5.0) -> dict[str, tuple[float, float]]:
    """Per tenant with a quota: (offered, admitted) requests per second after SETTLE_S."""
    scenario = load_sim_scenario(SCENARIO, {"duration_s": duration_s, "policy": {"quota_shares": mode}})
    result = simulate(plan_run(scenario))
    span = duration_s - SETTLE_S
    rates = {}
    for tenant in scenario.quotas:
        mine = [
            r
            for r in result.records
            if scenario.classes[r.cls].tenant == tenant and r.scheduled_s >= SETTLE_S
        ]
        admitted = sum(1 for r in mine if r.reason not in QUOTA_REASONS)
        rates[tenant] = (len(mine) / span, admitted / span)
    return rates


def test_twenty_routers_with_skewed_placement_give_every_tenant_its_quota() -> None:
    demand = admitted_rates("demand")
    assert demand["sticky"][1] == pytest.approx(60, rel=0.1)  # all on router 0: its whole rate
    assert demand["skewed"][1] == pytest.approx(200, rel=0.1)  # 80 % on two routers
    assert demand["even"][1] == pytest.approx(300, rel=0.1)
    offered, admitted = demand["light"]  # under its limit on one router: nothing refused
    assert admitted >= 0.97 * offered
    equal = admitted_rates("equal")
    assert equal["sticky"][1] <= 60 / 20 * 1.2  # what the equal split gives a sticky tenant: 1/20
    assert equal["light"][1] <= 100 / 20 * 1.2


def test_the_summary_reports_each_tenant_against_its_limit(capsys: pytest.CaptureFixture[str]) -> None:
    scenario = load_sim_scenario(SCENARIO, {"duration_s": 2.0})
    tenants: dict[str, Any] = simulate(plan_run(scenario)).summary()["tenants"]
    assert set(tenants) == {"sticky", "skewed", "even", "light"}
    assert tenants["sticky"]["limit_rps"] == 60 and tenants["sticky"]["offered_rps"] > 100
    assert 0 < tenants["sticky"]["admitted_of_limit_pct"] <= 100
    assert bench_main(["--duration", "1", "--routers", "6"]) == 0
    assert "| sticky | 100% on 0 | 60 |" in capsys.readouterr().out


def test_a_placement_outside_the_routers_is_refused() -> None:
    with pytest.raises(ScenarioError, match="placement"):
        parse_sim_scenario(
            {
                "duration_s": 1,
                "rate": 10,
                "routers": 2,
                "classes": [{"name": "a", "deadline_ms": 100, "placement": [2]}],
            }
        )
