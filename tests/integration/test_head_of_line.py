"""Head-of-line protection end to end: long inputs (their own lane, 30x the per-row cost) arriving at one
per ten short ones leave the short requests' p99 within 20 % of what it is without them.

What protects the short ones: long inputs get their own lane (bucket 256); a batch is capped by cost
(`max_batch_cost` 256 padded elements: one long row), so a long batch holds a worker for one row's time;
and the expected-completion scheduler sends short batches to the worker that is not busy with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.loadgen import run_scenario
from bench.loadgen_scenario import parse_scenario
from router.main import RouterServer
from tests.integration.conftest import MakeRouter, Spawn, accepting_workers
from tests.support.processes import eventually

pytestmark = pytest.mark.integration

SHORT, LONG = 8, 256
RATE_SHORT = 150.0


def repository(root: Path) -> Path:
    """`seq`: a simulated sequence model, t = 3 ms + 0.1 ms/row + 0.02 ms/row/token, buckets 16 and 256."""
    folder = root / "seq"
    (folder / "1").mkdir(parents=True)
    config = {
        "name": "seq",
        "backend": "synthetic",
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [4]}],
        "max_batch_size": 16,
        "batching": {"max_wait_ms": 2.0, "buckets": {"x": [16, 256]}, "max_batch_cost": 256},
        "synthetic": {"base_ms": 3.0, "per_item_ms": 0.1, "per_token_ms": 0.02},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return root


async def short_p99(router: RouterServer, *, with_long: bool) -> float:
    classes: list[dict[str, Any]] = [
        {"name": "short", "weight": 10, "model": "seq", "deadline_ms": 2000, "length": SHORT}
    ]
    if with_long:
        classes.append({"name": "long", "weight": 1, "model": "seq", "deadline_ms": 2000, "length": LONG})
    rate = RATE_SHORT * (1.1 if with_long else 1.0)
    load = {
        "target": f"127.0.0.1:{router.port}",
        "duration_s": 10,
        "rate": rate,
        "seed": 9,
        "classes": classes,
    }
    report = await run_scenario(parse_scenario(load))
    short = next(c for c in report["classes"] if c["name"] == "short")
    assert short["ok"] == short["offered"]
    return float(short["latency_ms"]["p99"])


async def test_long_inputs_do_not_hold_short_ones_hostage(
    make_router: MakeRouter, spawn: Spawn, tmp_path: Path
) -> None:
    repo = repository(tmp_path / "models")
    router = await make_router()
    spawn("w-1", models="seq", repository=repo)
    spawn("w-2", models="seq", repository=repo)
    await eventually(lambda: len(accepting_workers(router)) == 2, 60, "workers accepted")
    await short_p99(router, with_long=True)  # warm the estimates of both lanes
    alone, mixed = [], []
    for _ in range(2):  # interleaved, so drift in the machine's load hits both sides alike
        alone.append(await short_p99(router, with_long=False))
        mixed.append(await short_p99(router, with_long=True))
    assert sum(mixed) <= 1.2 * sum(alone), (alone, mixed)
