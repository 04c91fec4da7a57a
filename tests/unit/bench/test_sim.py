"""The simulator's mechanics: determinism, exactly-once outcomes, the shared arrival schedule, scenario
validation, scale, and the `sluice sim` command. Virtual time only: no sleeping, no network."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice_inference.bench.loadgen_scenario import ScenarioError, parse_scenario
from sluice_inference.bench.loadgen_schedule import build_schedule
from sluice_inference.bench.sim.core_speed import measure as measure_core
from sluice_inference.bench.sim.engine import Simulation, simulate
from sluice_inference.bench.sim.plan import plan_run
from sluice_inference.bench.sim.scenario import Variant, load_sim_scenario, parse_sim_scenario
from sluice_inference.cli.sim_cmd import add_sim_parser, run_sim
from tests.support.garbage import cyclic_garbage

SCENARIOS = Path(__file__).resolve().parents[3] / "bench" / "scenarios"
APP = {"name": "app", "deadline_ms": 100}


def scenario(**fields: Any) -> Any:
    """A small valid scenario with `fields` replaced."""
    noise = {"sigma": 0.2, "stall_p": 0.01, "stall_ms": 30}
    base: dict[str, Any] = {"duration_s": 2, "load": 0.5, "seed": 3, "classes": [APP],
                            "workers": [{"count": 3}], "noise": noise}  # fmt: skip
    return parse_sim_scenario({**base, **fields})


def busy_scenario() -> Any:
    """Overload with priorities, tiny lane bounds, impossible deadlines, a crash, a hang and a drain:
    every way a request can end."""
    return scenario(
        load=1.6, duration_s=2,
        classes=[
            {"name": "gold", "weight": 1, "tenant": "gold", "priority": 1, "deadline_ms": 60},
            {"name": "bronze", "weight": 4, "tenant": "bronze", "priority": 3, "deadline_ms": 60},
            {"name": "hopeless", "weight": 0.2, "deadline_ms": 4},
        ],
        workers=[{"count": 4}],
        policy={"lane_max_queued": 40},
        failures=[{"worker": "w0", "at_s": 0.5}, {"worker": "w1", "at_s": 1.0, "detect_ms": 500},
                  {"worker": "w2", "at_s": 1.5, "kind": "drain"}],
    )  # fmt: skip


def records_of(plan_scenario: Any, variant: Variant | None = None) -> list[Any]:
    return simulate(plan_run(plan_scenario, variant)).records


def test_same_seed_same_outcomes_and_another_seed_differs() -> None:
    first = records_of(busy_scenario())
    assert first == records_of(busy_scenario())
    other = parse_sim_scenario({**busy_scenario().model_dump(), "seed": 4})
    assert records_of(other) != first


def test_every_arrival_ends_exactly_once_and_nothing_is_left_behind() -> None:
    sim = Simulation(plan_run(busy_scenario()))
    result = sim.run()
    assert len(result.records) == sim.plan.arrivals > 1000
    outcomes = {f"{r.code}/{r.reason}" for r in result.records}
    for expected in ("OK/", "UNAVAILABLE/worker_lost", "INVALID_ARGUMENT/deadline_too_short"):
        assert expected in outcomes
    assert any(o.startswith("UNAVAILABLE/") and "worker_lost" not in o for o in outcomes)  # shed
    assert any(o.startswith("DEADLINE_EXCEEDED/") for o in outcomes)  # expired
    # every admission slot came back, and the core holds no request any more
    [core] = sim.cores
    assert set(core.admission.limiter.inflight.values()) == {0}
    assert core.queues.queued() == 0
    assert not core.in_flight
    assert "w2" not in core.workers  # drained and gone
    assert all(r.latency_s >= 0 for r in result.records)


def test_a_run_leaves_no_cyclic_garbage() -> None:
    """Every object a run makes, refusals and failures included, is freed by its last reference: what lets
    a run space its young collections out (engine.py `RUN_YOUNG_THRESHOLD`)."""
    busy = busy_scenario()
    quotas = {"bronze": {"rate": 100, "burst": 5}}
    runs = [
        Simulation(plan_run(busy)),
        Simulation(plan_run(parse_sim_scenario({**busy.model_dump(), "quotas": quotas}))),
    ]
    with cyclic_garbage() as garbage:
        results = [run.run() for run in runs]
    reasons = {r.reason for result in results for r in result.records}
    assert {"tenant_rate", "queue_full", "shed", "worker_lost", "deadline_too_short"} <= reasons
    assert garbage.found == 0


def test_ok_answers_meet_their_deadline_and_include_the_overhead() -> None:
    quiet = {"sigma": 0.0, "stall_p": 0.0, "stall_ms": 0}
    result = simulate(plan_run(scenario(overhead_ms=2.0, noise=quiet)))
    ok = [r for r in result.records if r.ok]
    assert ok
    assert all(r.latency_s <= r.deadline_s for r in ok)
    assert min(r.latency_s for r in ok) >= 0.002 + 0.005  # overhead + t(1) on a noiseless speed-1 device


def test_arrivals_are_the_load_generators_schedule() -> None:
    sim = scenario(rate=400.0, load=None, classes=[{**APP, "weight": 1}, {**APP, "name": "b", "weight": 3}])
    bench = parse_scenario({"duration_s": 2, "rate": 400, "seed": 3, "classes": [
        {"name": "app", "weight": 1, "model": "m", "deadline_ms": 100},
        {"name": "b", "weight": 3, "model": "m", "deadline_ms": 100}]})  # fmt: skip
    plan, schedule = plan_run(sim), build_schedule(bench)
    assert np.array_equal(np.asarray(plan.times_s), schedule.times_s)
    assert plan.classes == schedule.classes.tolist()


def test_dropping_a_class_keeps_the_others_arrivals() -> None:
    mix = scenario(classes=[APP, {**APP, "name": "long", "length": 512, "weight": 0.3}])
    full = plan_run(mix)
    short_only = plan_run(mix, Variant(name="short", drop_classes=["long"]))
    kept = [t for t, c in zip(full.times_s, full.classes, strict=True) if c == 0]
    assert short_only.times_s == kept
    assert set(short_only.classes) == {0}


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"rate": 10.0}, "give exactly one of rate and load"),
        ({"failures": [{"worker": "nope", "at_s": 1}]}, "unknown worker"),
        ({"variants": [{"name": "v", "drop_classes": ["x"]}]}, "unknown classes"),
        ({"variants": [{"name": "v", "policy": {"batcher": "fifo"}}]}, "batcher"),
        ({"classes": [{"name": "a"}]}, "classes.0.deadline_ms"),
    ],
)
def test_bad_scenarios_name_the_problem(fields: dict[str, Any], key: str) -> None:
    with pytest.raises((ScenarioError, ValueError), match=key):
        scenario(**fields)


def test_every_shipped_scenario_loads() -> None:
    paths = sorted(SCENARIOS.glob("sim_*.yaml"))
    assert len(paths) >= 7
    for path in paths:
        assert load_sim_scenario(path).capacity_rps > 0


def test_a_thousand_workers() -> None:
    scale = load_sim_scenario(SCENARIOS / "sim_scale.yaml", {"duration_s": 0.01, "load": 0.1})
    result = simulate(plan_run(scale))
    assert len(result.workers) == 1000
    assert len(result.records) == result.plan.arrivals > 1000
    assert all(r.ok for r in result.records)
    used = [w.batches for w in result.workers if w.batches]
    assert len(used) >= 0.9 * len(result.batch_rows) and max(used) <= 3  # spread, not piled on a few


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers(dest="command"))
    return run_sim(parser.parse_args(["sim", *argv]))


def test_cli_runs_compares_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs.json"
    path = str(SCENARIOS / "sim_slow_worker.yaml")
    assert _cli(path, "--duration", "1", "--compare", "--json", str(out), "--markdown") == 0
    runs = json.loads(out.read_text())
    assert [r["variant"] for r in runs] == ["expected_completion", "least_loaded", "round_robin"]
    printed = capsys.readouterr().out
    assert "| expected_completion |" in printed
    assert "requests per wall-clock second" in printed
    assert _cli(path, "--duration", "1", "--scheduler", "round_robin", "--load", "0.2") == 0
    assert "round_robin" not in capsys.readouterr().out.split("variant")[0]


def test_cli_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(SCENARIOS / "sim_steady.yaml")
    assert _cli(path, "--rate", "10", "--load", "1") == 1
    assert _cli(path, "--plot", "x.png") == 1
    assert _cli(path, "--class", "nope", "--duration", "0.1") == 1
    assert "no class named 'nope'" in capsys.readouterr().err


def test_sweep_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    path = str(SCENARIOS / "sim_headroom.yaml")
    assert _cli(path, "--duration", "0.5", "--sweep", "0.05,0.1", "--plot", str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_core_alone_runs_whole_batches_of_the_size_asked() -> None:
    speed = measure_core(4, 40)  # it raises if a cycle's batch is not 4 rows
    assert (speed.rows, speed.requests) == (4, 40) and speed.cpu_s > 0
    assert measure_core(3, 10).requests == 12  # whole cycles
    with pytest.raises(ValueError, match="rows must lie in"):
        measure_core(0, 10)
