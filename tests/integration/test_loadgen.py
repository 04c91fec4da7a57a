"""The load generator against a real in-process gRPC sink: every scheduled request is sent once and
accounted for once, at the offered rate; the CLI writes its JSON report; the ceiling ramp runs.

The rate asserted (200 req/s within 5 %) is far below the generator's ceiling (2,000-7,000 req/s against
a sink in its own process here, docs/loadgen.md; the sink in this process takes a share of that), so it
holds on a slower core too (checked with the CPU limited to 0.8 of a core, tests/slow_machine.sh); the
ceiling smoke test asserts no figure that depends on speed."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from sluice_inference.bench.loadgen import run_scenario
from sluice_inference.bench.loadgen_ceiling import measure_ceiling
from sluice_inference.bench.loadgen_scenario import parse_scenario
from sluice_inference.bench.loadgen_sink import SinkServer, SinkServicer
from sluice_inference.cli.bench_cmd import add_bench_parser, run_bench
from sluice_inference.cli.main import _Parser
from sluice_inference.common.config import load_config
from sluice_inference.common.local_cluster import free_port
from sluice_inference.router.policy.tenants import hash_api_key
from tests.integration.conftest import MakeRouter

pytestmark = pytest.mark.integration

REJECT_EVERY = 7
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def sink() -> AsyncIterator[tuple[SinkServicer, str]]:
    """A sink that rejects every 7th request with UNAVAILABLE/queue_full (hint 50 ms)."""
    servicer = SinkServicer(reject_every=REJECT_EVERY)
    server = SinkServer(servicer)
    addr = await server.start()
    try:
        yield servicer, addr
    finally:
        await server.stop(0)


def _scenario_data(target: str) -> dict[str, object]:
    return {
        "target": target,
        "duration_s": 2,
        "rate": 200,
        "seed": 4,
        "channels": 2,
        "classes": [
            {
                "name": "gold",
                "weight": 1,
                "tenant_key": "g",
                "priority": 1,
                "model": "sink",
                "deadline_ms": 500,
            },
            {"name": "bronze", "weight": 5, "priority": 3, "model": "sink", "deadline_ms": 500, "rows": 2},
        ],
    }


async def test_every_request_is_sent_once_and_accounted_for_once(sink: tuple[SinkServicer, str]) -> None:
    servicer, addr = sink
    report = await run_scenario(parse_scenario(_scenario_data(addr)))
    total = report["total"]
    assert report["scheduled"] == 400 == total["offered"]
    assert servicer.infer_calls == 400  # each scheduled request reached the server exactly once
    assert total["ok"] + total["rejected"] == 400
    assert total["rejected_by_status"] == {"UNAVAILABLE/queue_full": 400 // REJECT_EVERY}
    assert total["rejected_with_hint"] == 400 // REJECT_EVERY
    assert total["late_ok"] == 0 and total["good"] == total["ok"]
    assert sum(c["offered"] for c in report["classes"]) == 400
    assert total["offered_rps"] == 200.0
    assert report["achieved_send_rps"] == pytest.approx(200, rel=0.05)
    assert sum(report["timeline"]["total"]["offered"]) == 400
    assert report["send_lag_ms"]["p99"] < 50  # loose: CI machines are shared
    assert report["warnings"] == [] or "send lag" in report["warnings"][0]


async def test_cli_prints_the_table_and_writes_json(
    sink: tuple[SinkServicer, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, addr = sink
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(_scenario_data("nowhere:1")))  # JSON is YAML; --target overrides it
    out = tmp_path / "report.json"
    args = _parse(["bench", str(path), "--target", addr, "--duration", "1", "--json", str(out)])
    assert await asyncio.to_thread(run_bench, args) == 0  # run_bench owns its event loop
    printed = capsys.readouterr().out
    assert "bronze" in printed and "UNAVAILABLE/queue_full=" in printed
    report = json.loads(out.read_text())
    assert report["scheduled"] == 200 and report["scenario"]["target"] == addr
    assert set(report["timeline"]["by_class"]) == {"gold", "bronze"}


def test_cli_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(_scenario_data(f"127.0.0.1:{free_port()}")))  # nothing listens
    assert run_bench(_parse(["bench", str(path), "--connect-timeout", "0.5"])) == 2
    path.write_text("duration_s: 1\nrate: 1\nclasses: [{name: c, model: m}]\n")
    assert run_bench(_parse(["bench", str(path)])) == 1  # deadline_ms missing
    assert run_bench(_parse(["bench"])) == 1


async def test_ceiling_ramp_smoke() -> None:
    report = await measure_ceiling(steps=(100, 200), step_s=0.5, channels=1, in_process=True)
    steps = report["steps"]
    # The ramp goes up in order and stops at its first failing step only: whether a half-second step
    # passes (its p99 send lag under 5 ms) is this machine's business at that moment, not the code's.
    assert [s["rate"] for s in steps] == [100, 200][: len(steps)] and steps
    assert all(s["passed"] for s in steps[:-1])
    assert len(steps) == 2 or not steps[-1]["passed"]
    assert all(s["not_ok"] == 0 for s in steps)  # the sink answers every call
    assert report["ceiling_rps"] == max((s["rate"] for s in steps if s["passed"]), default=0)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="sluice")
    add_bench_parser(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    return parser.parse_args(argv)


@pytest.mark.parametrize("scenario", ["steady.yaml", "overload.yaml"])
async def test_a_scenario_whose_keys_the_cluster_lacks_names_the_config_to_start_it_with(
    make_router: MakeRouter, scenario: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A router as `make run` starts it: no tenants configured, so key-less local mode.
    router = await make_router()
    path = REPO / "bench" / "scenarios" / scenario
    args = _parse(["bench", str(path), "--target", f"127.0.0.1:{router.port}", "--duration", "0.1"])
    assert await asyncio.to_thread(run_bench, args) == 3
    error = capsys.readouterr().err
    config = REPO / "bench" / "scenarios" / "cluster-tenants.yaml"
    assert "UNAUTHENTICATED" in error
    assert "the target does not know class 'gold''s tenant_key 'gold-key'" in error
    assert f"sluice up --config {config}" in error
    # And that config does know the scenario's keys.
    tenants = load_config(config).tenants
    keys = {c["tenant_key"] for c in yaml.safe_load(path.read_text())["classes"]}
    assert {hash_api_key(k) for k in keys} <= {h for t in tenants.values() for h in t.api_keys}
