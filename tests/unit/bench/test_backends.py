"""bench/backends.py runs end to end (tiny budget) and prints one row per backend and batch size."""

from __future__ import annotations

import pytest

from sluice_inference.bench.backends import main


def test_prints_every_backend_at_every_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--batches", "1,4", "--seconds", "0.05"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        (name, batch) for batch in ("1", "4") for name in ("torchscript", "onnx", "torch_export")
    ]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
