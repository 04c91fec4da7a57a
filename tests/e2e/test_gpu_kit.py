"""The GPU kit's CPU rehearsal (`bench/gpu/run.sh --device cpu --quick`), so the kit cannot rot between
GPU runs: the same script and stages on tiny shapes, asserted through the JSON it writes (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"cluster", "correctness", "device_curve", "end_to_end", "oom", "worker_kill", "router_cpu"}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu-kit")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "run.sh"), "--device", "cpu", "--quick"],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads((out / "gpu_kit.json").read_text()), out


def test_every_stage_ran_without_error(
    rehearsal: tuple[dict[str, Any], Path],
) -> None:
    report, _ = rehearsal
    assert report["errors"] == {}
    assert set(report["stages"]) == STAGES
    assert report["kit"]["device"] == "cpu" and report["kit"]["quick"] is True


def test_answers_through_the_router_equal_the_model_in_process(
    rehearsal: tuple[dict[str, Any], Path],
) -> None:
    correctness = rehearsal[0]["stages"]["correctness"]
    assert correctness["passed"]
    assert correctness["alone"]["bert"]["bit_exact"]  # FP32 alone, on the CPU: bit for bit
    assert {"bert_fp16", "bert_bf16"} <= set(correctness["alone"])
    assert correctness["batched"]["passed"]


def test_curve_and_end_to_end_figures_are_there(rehearsal: tuple[dict[str, Any], Path]) -> None:
    stages = rehearsal[0]["stages"]
    curve = stages["device_curve"]["points"]
    assert {p["bucket"] for p in curve} == {8, 16, 32}
    assert all(p["items_per_s"] > 0 for p in curve)
    e2e = stages["end_to_end"]
    assert {s["model"] for s in e2e["steps"]} == {"bert", "bert_b1"}
    assert all(s["mean_batch"] is not None and s["mean_batch"] >= 1 for s in e2e["steps"])
    assert e2e["best"]["goodput_rps"] > 0 and e2e["best"]["ratio_to_in_process_bound"] is not None
    assert stages["router_cpu"]["router_cpu_ms_per_request"] > 0


def test_a_killed_worker_loses_nothing(rehearsal: tuple[dict[str, Any], Path]) -> None:
    stages = rehearsal[0]["stages"]
    kill = stages["worker_kill"]
    assert kill["nothing_lost"] and kill["lost"] == 0
    assert kill["answered"] == kill["offered"] > 0
    assert "skipped" in stages["oom"]  # CUDA only; says why


def test_plot_and_logs_come_back(rehearsal: tuple[dict[str, Any], Path]) -> None:
    report, out = rehearsal
    assert (out / report["plot"]["path"]).read_bytes().startswith(b"\x89PNG")
    assert {p.name for p in (out / "logs").iterdir()} >= {"etcd.log", "router.log", "worker-1.log"}
