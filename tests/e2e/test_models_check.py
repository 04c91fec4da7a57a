"""`sluice models check DIR`: validates a repository offline (no etcd, router or worker) and prints what
each model version will be served as; exit 1 naming the file and field when anything is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.triton_repo import write_triton_repository

pytestmark = pytest.mark.e2e


def check(repository: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "sluice_inference.cli", "models", "check", str(repository), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_a_mixed_repository_is_described_and_loaded(tmp_path: Path) -> None:
    run = check(write_triton_repository(tmp_path))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for expected in (
        "onnx_mlp v3: onnxruntime from config.pbtxt, artifact model.onnx",
        "peer_mlp v1: torchscript from config.pbtxt",
        "peer_mlp v2: torchscript from config.pbtxt",
        "toy v1: synthetic from config.yaml",
        "inputs  INPUT__0 FP32[-1, 16]",
        "max_batch_size 8, max_wait 0.5 ms, warm-up batches [1, 4, 8], device cpu",
        "loaded on cpu: forward(x: Tensor) -> Tensor",
        "loaded on cpu: inputs input: float[batch, 16] -> outputs output: float[batch, 4]",
        "warning: instance_group count 2",
        "4 model version(s)",
    ):
        assert expected in out, expected
    assert "onnx_mlp v1" not in out  # version_policy: latest 1


def test_a_config_that_does_not_fit_its_model_fails_the_check(tmp_path: Path) -> None:
    repository = write_triton_repository(tmp_path)
    config = repository / "peer_mlp" / "config.pbtxt"
    config.write_text(config.read_text().replace("INPUT__0", "input"))
    assert check(repository, "--no-load").returncode == 0  # the config itself is valid
    run = check(repository)
    assert run.returncode == 1
    assert "no parameter ['input']" in run.stdout and "forward(x: Tensor) -> Tensor" in run.stdout
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 0"))
    run = check(repository, "--no-load")
    assert run.returncode == 1
    assert f"{config}: max_batch_size: 0 is not supported" in run.stderr
