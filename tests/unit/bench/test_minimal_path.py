"""bench/minimal_path.py's TorchScript worker runs a model as Sluice's worker does (frozen), rows in and
rows out as bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sluice_inference.bench.minimal_path import torchscript_forward


def test_the_forward_answers_as_the_scripted_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    module = torch.jit.script(layers)
    path = tmp_path / "model.pt"
    module.save(str(path))  # type: ignore[no-untyped-call]
    rows = np.arange(12, dtype="<f4").reshape(3, 4)
    answer = np.frombuffer(torchscript_forward(path, in_width=4)(rows.tobytes()), "<f4").reshape(3, 3)
    with torch.no_grad():
        expected = module.eval()(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(answer, expected, rtol=1e-6, atol=1e-6)
