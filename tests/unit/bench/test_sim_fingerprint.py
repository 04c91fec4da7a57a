"""The simulator's fingerprint (bench/sim/fingerprint.py): it repeats for a seed, moves with a decision, and
its command tells identical runs from changed ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice_inference.bench.sim.engine import simulate
from sluice_inference.bench.sim.fingerprint import fingerprint, main
from sluice_inference.bench.sim.plan import plan_run
from sluice_inference.bench.sim.scenario import load_sim_scenario

SCENARIO = Path(__file__).resolve().parents[3] / "bench" / "scenarios" / "sim_hol_seq.yaml"


def test_a_seeded_run_has_the_same_fingerprint_every_time() -> None:
    scenario = load_sim_scenario(SCENARIO)
    assert fingerprint(simulate(plan_run(scenario))) == fingerprint(simulate(plan_run(scenario)))


def test_other_arrivals_or_another_policy_change_the_fingerprint() -> None:
    scenario = load_sim_scenario(SCENARIO)
    plain = fingerprint(simulate(plan_run(scenario)))
    reseeded = load_sim_scenario(SCENARIO, {"seed": scenario.seed + 1})
    timer = load_sim_scenario(SCENARIO, {"policy": {"batcher": "timer"}})
    others = [fingerprint(simulate(plan_run(s))) for s in (reseeded, timer)]
    assert len({plain, *others}) == 3


def test_the_command_passes_identical_runs_and_names_a_changed_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "before.json"
    assert main([str(SCENARIO), "--out", str(saved)]) == 0
    assert main([str(SCENARIO), "--against", str(saved)]) == 0
    before = json.loads(saved.read_text())
    assert SCENARIO.name in before and len(before) > 1  # the scenario as written, and its variants
    saved.write_text(json.dumps({**before, SCENARIO.name: "0" * 16}))
    capsys.readouterr()
    assert main([str(SCENARIO), "--against", str(saved)]) == 1
    assert f"differ: ['{SCENARIO.name}']" in capsys.readouterr().out
