"""The load generator's pure parts: arrival processes, class mix, scenario validation, request plans, and
the summary statistics computed from synthetic records. No network, no sleeping."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice_inference.bench.loadgen import plan_class, rejection
from sluice_inference.bench.loadgen_scenario import (
    Arrivals,
    Scenario,
    ScenarioError,
    load_scenario,
    parse_scenario,
)
from sluice_inference.bench.loadgen_schedule import arrival_times, build_schedule, class_picks, unit_gaps
from sluice_inference.bench.loadgen_stats import (
    ClassLabel,
    RequestRecord,
    achieved_send_rps,
    format_report,
    percentiles_ms,
    summarize,
    timeline,
)
from sluice_inference.common.errors import InvalidArgument, Unavailable
from sluice_inference.common.grpc_errors import trailers_for
from sluice_inference.common.pb.inference import grpc_service_pb2 as kserve

SCENARIOS = Path(__file__).resolve().parents[3] / "bench" / "scenarios"
GOLD = {
    "name": "gold",
    "weight": 1,
    "tenant_key": "gold-key",
    "priority": 1,
    "model": "m",
    "deadline_ms": 500,
}
BRONZE = {**GOLD, "name": "bronze", "weight": 5, "tenant_key": "bronze-key", "priority": 3}


def scenario(**overrides: object) -> Scenario:
    data = {"duration_s": 10, "rate": 100, "classes": [GOLD, BRONZE], **overrides}
    return parse_scenario(data)


def cv(values: np.ndarray) -> float:
    return float(np.std(values) / np.mean(values))


# --- arrival processes ---------------------------------------------------------------------------------


def test_poisson_gaps_have_unit_mean_and_cv_1() -> None:
    gaps = unit_gaps(Arrivals(), 200_000, np.random.default_rng(0))
    assert np.mean(gaps) == pytest.approx(1.0, rel=0.01)
    assert cv(gaps) == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("want", [0.5, 2.0, 4.0])
def test_gamma_gaps_have_the_requested_cv(want: float) -> None:
    gaps = unit_gaps(Arrivals(process="gamma", cv=want), 400_000, np.random.default_rng(1))
    assert np.mean(gaps) == pytest.approx(1.0, rel=0.03)
    assert cv(gaps) == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("arrivals", [Arrivals(), Arrivals(process="gamma", cv=4)])
def test_schedule_offers_exactly_the_rate_and_keeps_the_burstiness(arrivals: Arrivals) -> None:
    times = arrival_times(arrivals, 100_000, 200.0, np.random.default_rng(2))
    assert len(times) == 100_000  # rate 500/s over 200 s, exactly
    assert np.all(np.diff(times) >= 0) and times[0] > 0 and times[-1] < 200.0
    gaps = np.diff(times)
    assert np.mean(gaps) == pytest.approx(200.0 / 100_000, rel=0.01)
    assert cv(gaps) == pytest.approx(arrivals.cv or 1.0, rel=0.1)
    # mean rate over any 20 s window stays near 500/s for Poisson
    if arrivals.process == "poisson":
        per_window = np.histogram(times, bins=10, range=(0, 200))[0] / 20.0
        assert np.all(np.abs(per_window - 500) < 0.05 * 500)


def test_class_mix_follows_the_weights() -> None:
    picks = class_picks([1.0, 5.0], 60_000, np.random.default_rng(3))
    assert np.mean(picks == 0) == pytest.approx(1 / 6, abs=0.01)
    assert set(np.unique(picks)) == {0, 1}


def test_schedule_is_fixed_by_the_seed_and_its_streams_are_independent() -> None:
    a, b = build_schedule(scenario(seed=5)), build_schedule(scenario(seed=5))
    assert np.array_equal(a.times_s, b.times_s) and np.array_equal(a.classes, b.classes)
    assert len(a) == 1000
    assert not np.array_equal(a.times_s, build_schedule(scenario(seed=6)).times_s)
    reweighted = build_schedule(scenario(seed=5, classes=[GOLD, {**BRONZE, "weight": 1}]))
    assert np.array_equal(a.times_s, reweighted.times_s)  # changing the mix does not move arrivals


# --- scenario validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"classes": []}, "classes: List should have at least 1 item"),
        ({"rate": 0}, "rate: Input should be greater than 0"),
        ({"classes": [{**GOLD, "deadline_ms": 0}]}, "classes.0.deadline_ms: Input should be greater than 0"),
        (
            {"classes": [GOLD, {**BRONZE, "prioirty": 2}]},
            "classes.1.prioirty: Extra inputs are not permitted",
        ),
        ({"classes": [{**GOLD, "priority": -1}]}, "classes.0.priority"),
        ({"classes": [{**GOLD, "length": [8, 0]}]}, "classes.0.length"),
        ({"arrivals": {"process": "gamma"}}, "arrivals: Value error, cv is required"),
        ({"arrivals": {"process": "poisson", "cv": 2}}, "cv applies to process: gamma only"),
        ({"arrivals": {"process": "uniform"}}, "arrivals.process"),
        ({"classes": [GOLD, GOLD]}, "duplicate name(s) gold"),
        ({"rate": 1e6, "duration_s": 3600}, "rate * duration_s must be at most"),
        ({"channels": 0}, "channels"),
    ],
)
def test_scenario_errors_name_the_key(change: dict[str, object], message: str) -> None:
    with pytest.raises(ScenarioError) as raised:
        scenario(**change)
    assert message in str(raised.value)


def test_missing_keys_and_non_mappings_are_reported() -> None:
    with pytest.raises(ScenarioError, match="duration_s: Field required"):
        parse_scenario({"rate": 1, "classes": [GOLD]})
    with pytest.raises(ScenarioError, match="mapping"):
        parse_scenario([1, 2])


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "target: a:1\nduration_s: 5\nrate: 10\nclasses: [{name: c, model: m, deadline_ms: 100}]\n"
    )
    loaded = load_scenario(path, {"target": "b:2", "rate": 20.0, "seed": None})
    assert (loaded.target, loaded.rate, loaded.seed, loaded.scheduled) == ("b:2", 20.0, 0, 100)
    path.write_text("classes: [")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(path)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", ["steady.yaml", "overload.yaml", "bursty.yaml"])
def test_shipped_scenarios_are_valid(name: str) -> None:
    loaded = load_scenario(SCENARIOS / name)
    assert loaded.classes


def test_overload_mix_is_half_and_two_and_a_half_capacities() -> None:
    overload = load_scenario(SCENARIOS / "overload.yaml", {"rate": 3.0})  # C = 1 req/s
    total = sum(c.weight for c in overload.classes)
    shares = {c.name: overload.rate * c.weight / total for c in overload.classes}
    assert shares == {"gold": pytest.approx(0.5), "bronze": pytest.approx(2.5)}
    assert {c.name: c.priority for c in overload.classes} == {"gold": 1, "bronze": 3}


# --- request plans ---------------------------------------------------------------------------------------


def test_plan_fills_variable_dims_and_sends_the_deadline_twice() -> None:
    meta = kserve.ModelMetadataResponse(name="enc")
    meta.inputs.add(name="tokens", datatype="INT64", shape=[-1, -1])
    meta.inputs.add(name="extra", datatype="FP32", shape=[-1, 3, -1])
    cls = parse_scenario(
        {"duration_s": 1, "rate": 1, "classes": [{**GOLD, "rows": 2, "length": [4, 9], "payloads": 3}]}
    ).classes[0]
    plan = plan_class(cls, meta, np.random.default_rng(0))
    assert len(plan.variants) == 6 and plan.deadline_s == 0.5
    assert plan.metadata == (("authorization", "Bearer gold-key"),)
    shapes = sorted({tuple(v.inputs[1].shape) for v in plan.variants})
    assert shapes == [(2, 3, 4), (2, 3, 9)]
    request = plan.variants[0]
    assert len(request.raw_input_contents[0]) == 2 * 4 * 8
    assert request.parameters["timeout"].int64_param == 500_000
    assert request.parameters["priority"].int64_param == 1
    assert "cache" not in request.parameters
    anonymous = plan_class(
        cls.model_copy(update={"tenant_key": None, "priority": 0}), meta, np.random.default_rng(0)
    )
    assert anonymous.metadata == () and "priority" not in anonymous.variants[0].parameters


def test_rejection_reads_status_reason_and_hint() -> None:
    def error(err: Unavailable | InvalidArgument, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        trailers = grpc.aio.Metadata(*trailers_for(err))
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=err.message)

    shed = error(Unavailable("shed", reason="shed", retry_after_s=0.1), grpc.StatusCode.UNAVAILABLE)
    assert rejection(shed) == ("UNAVAILABLE", "shed", True)
    bad = error(InvalidArgument("bad", reason="bad_shape"), grpc.StatusCode.INVALID_ARGUMENT)
    assert rejection(bad) == ("INVALID_ARGUMENT", "bad_shape", False)
    bare = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())
    assert rejection(bare) == ("UNAVAILABLE", "", False)


# --- summary statistics ----------------------------------------------------------------------------------

LABELS = [ClassLabel("gold", "gold", 1, "m"), ClassLabel("bronze", "bronze", 3, "m")]


def record(
    cls: int = 0,
    at: float = 0.0,
    latency: float = 0.01,
    code: str = "OK",
    *,
    reason: str = "",
    hint: bool = False,
) -> RequestRecord:
    return RequestRecord(cls, at, 0.0, latency, code, deadline_s=0.5, reason=reason, hint=hint)


def test_percentiles_of_known_samples() -> None:
    p = percentiles_ms([i / 1000 for i in range(1, 1001)])  # 1..1000 ms
    assert p["p50"] == pytest.approx(500.5)
    assert p["p90"] == pytest.approx(900.1)
    assert p["p99"] == pytest.approx(990.01)
    assert p["p99.9"] == pytest.approx(999.001)
    assert percentiles_ms([]) == {"p50": None, "p90": None, "p99": None, "p99.9": None}


def test_summary_counts_goodput_late_ok_and_rejections() -> None:
    records = [
        *(record(0, at=i * 0.01, latency=0.1) for i in range(100)),  # gold: 100 OK in time
        *(record(1, at=i * 0.01, latency=0.2) for i in range(50)),  # bronze: 50 OK in time
        *(record(1, at=5.0, latency=0.7) for _ in range(10)),  # bronze: 10 OK but late
        *(
            record(1, at=6.0, code="UNAVAILABLE", reason="queue_full", hint=True, latency=0.003)
            for _ in range(30)
        ),
        *(record(1, at=7.0, code="RESOURCE_EXHAUSTED", reason="rate_limited", hint=True) for _ in range(5)),
        record(1, at=9.5, code="DEADLINE_EXCEEDED", latency=0.5),
    ]
    report = summarize(records, LABELS, duration_s=10.0)
    gold, bronze = report["classes"]
    assert (gold["offered"], gold["ok"], gold["good"], gold["late_ok"], gold["rejected"]) == (
        100,
        100,
        100,
        0,
        0,
    )
    assert (gold["offered_rps"], gold["throughput_rps"], gold["goodput_rps"]) == (10.0, 10.0, 10.0)
    assert (bronze["offered"], bronze["ok"], bronze["good"], bronze["late_ok"]) == (96, 60, 50, 10)
    assert bronze["goodput_rps"] == 5.0 and bronze["throughput_rps"] == 6.0
    assert bronze["rejected_by_status"] == {
        "UNAVAILABLE/queue_full": 30,
        "RESOURCE_EXHAUSTED/rate_limited": 5,
        "DEADLINE_EXCEEDED/-": 1,
    }
    assert bronze["rejected_with_hint"] == 35
    refused = bronze["rejection_latency_ms"]  # how soon each kind of refusal came back
    assert refused["UNAVAILABLE/queue_full"]["p99"] == pytest.approx(3.0)
    assert refused["DEADLINE_EXCEEDED/-"]["p50"] == pytest.approx(500.0)
    assert gold["latency_ms"]["p99"] == pytest.approx(100.0)
    assert bronze["latency_mean_ms"] == pytest.approx((50 * 200.0 + 10 * 700.0) / 60)  # OK answers only
    assert report["total"]["offered"] == 196 and report["total"]["late_ok"] == 10
    table = format_report(report)
    assert "gold" in table and "UNAVAILABLE/queue_full=30" in table and "late_ok" in table
    assert "UNAVAILABLE/queue_full answered after p50 3.00 ms, p99 3.00 ms" in table


def test_timeline_buckets_by_scheduled_second() -> None:
    records = [
        record(at=0.2),
        record(at=0.9, code="UNAVAILABLE"),
        record(at=2.5, latency=0.9),
        record(at=2.99),
    ]
    series = timeline(records, duration_s=3.0)
    assert series == {
        "t_s": [0, 1, 2],
        "offered": [2, 0, 2],
        "ok": [1, 0, 2],
        "good": [1, 0, 1],
        "rejected": [1, 0, 0],
    }


def test_achieved_send_rate_counts_lag_against_the_generator() -> None:
    on_time = [record(at=i / 100) for i in range(100)]
    assert achieved_send_rps(on_time, duration_s=1.0) == pytest.approx(100.0)
    late = [RequestRecord(0, i / 100, 0.5 * i / 100, 0.01, "OK", 0.5) for i in range(100)]  # falls behind
    assert achieved_send_rps(late, duration_s=1.0) == pytest.approx(100 / 1.485)
