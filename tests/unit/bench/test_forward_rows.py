"""bench/forward_rows.py times a TorchScript forward per batch size and prints one line per size."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from sluice_inference.bench import forward_rows


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "linear.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(8, 2)), str(path))
    return path


def test_a_forward_costs_some_cpu_per_call(model_file: Path) -> None:
    model = torch.jit.load(str(model_file)).eval()  # type: ignore[no-untyped-call]
    assert 0 < forward_rows.cpu_per_forward(model, rows=4, features=8, calls=50) < 1.0


@pytest.mark.parametrize("spin", [False, True])
def test_the_gap_between_forwards_is_not_counted(model_file: Path, spin: bool) -> None:
    model = torch.jit.load(str(model_file)).eval()  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    assert forward_rows.cpu_per_forward(model, rows=4, features=8, calls=5, gap_s=0.05, spin=spin) < 0.02
    assert time.perf_counter() - started >= 5 * 0.05  # the gaps were kept, asleep or busy


@pytest.mark.parametrize("as_loaded", [False, True])
def test_it_prints_the_module_s_form_and_one_line_per_batch_size(
    model_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], as_loaded: bool
) -> None:
    frozen: list[torch.jit.ScriptModule] = []

    def for_inference(module: torch.jit.ScriptModule, artifact: Path) -> torch.jit.ScriptModule:
        frozen.append(module)
        return module

    monkeypatch.setattr(forward_rows, "for_inference", for_inference)
    argv = ["forward_rows", str(model_file), "--features", "8", "--rows", "1,3,16", "--calls", "20"]
    monkeypatch.setattr(sys, "argv", argv + ["--as-loaded"] * as_loaded)
    forward_rows.main()
    lines = capsys.readouterr().out.splitlines()
    assert ("as loaded" in lines[0]) is as_loaded and len(frozen) == (not as_loaded)
    assert lines[1].split()[0] == "rows"
    assert [int(line.split()[0]) for line in lines[2:]] == [1, 3, 16]
    per_call, per_row = (float(v) for v in lines[-1].split()[1:])
    assert per_row == pytest.approx(per_call / 16, abs=1)
